"""The training passes' RMSNorm with its weight gradient on a Triton column reduction
(parallel.norm_wgrad=triton; models/build.py TorchRMSNorm).

torch's RMSNorm backward on CUDA runs two kernels per norm: the input gradient (near its memory
traffic) and the weight gradient, a reduction over every row (`GammaBetaBackward`), which the H100
update profile put at about three times its traffic at the recipe's shapes (20,480 rows of 896).
Here the forward and the input gradient stay torch's own fused kernels (`_fused_rms_norm` and
`_fused_rms_norm_backward` with the weight's output masked off); the weight gradient
dweight = sum over rows of g * x * rstd (rstd the forward's 1 / rms per row, kept by torch's
forward) is one Triton kernel over (column block, row split) programs, each summing its rows in
fp32 into a (splits, N) buffer, then one sum over the splits. x and g are read once each.

`rms_norm(x, weight, eps)`: differentiable in x and weight; off CUDA (or without Triton, or for
shapes `supported` does not take) it is F.rms_norm. `weight_grad(g, x, rstd)` is the kernel
(`impl` as in kernels/_dispatch.use_triton; the twin is the same sum in PyTorch).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._dispatch import HAVE_TRITON, interpreting, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _wgrad_kernel(g_ptr, x_ptr, r_ptr, part_ptr, M, N, ROWS_PER_SPLIT,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        col_block, split = tl.program_id(0), tl.program_id(1)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = split * ROWS_PER_SPLIT
        for start in range(first, first + ROWS_PER_SPLIT, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            off = rows.to(tl.int64)[:, None] * N + cols[None, :]
            g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
            acc += g * x * r[:, None]
        tl.store(part_ptr + split * N + cols, tl.sum(acc, axis=0), mask=cmask)


BLOCK_N = 128
BLOCK_M = 32


@functools.cache
def _programs(device_index: int) -> int:
    """Programs to aim for: 4 a multiprocessor on a GPU, a few under the interpreter."""
    if interpreting() or not torch.cuda.is_available():
        return 4
    return 4 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _weight_grad_twin(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    N = x.shape[-1]
    prod = g.reshape(-1, N).float() * x.reshape(-1, N).float() * rstd.reshape(-1, 1).float()
    return prod.sum(0)


def weight_grad(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                impl: str = "auto") -> torch.Tensor:
    """sum over rows of g * x * rstd, in fp32 (N,): g and x (..., N) contiguous, rstd one fp32
    per row (torch's `_fused_rms_norm` second output)."""
    if not use_triton(x, impl):
        return _weight_grad_twin(g, x, rstd)
    N = x.shape[-1]
    g2, x2, r = g.reshape(-1, N), x.reshape(-1, N), rstd.reshape(-1).float().contiguous()
    M = x2.shape[0]
    if M == 0:
        return torch.zeros(N, dtype=torch.float32, device=x.device)
    col_blocks = triton.cdiv(N, BLOCK_N)
    splits = max(1, min(triton.cdiv(M, BLOCK_M),
                        _programs(x.device.index or 0) // col_blocks))
    rows_per = triton.cdiv(triton.cdiv(M, splits), BLOCK_M) * BLOCK_M
    splits = triton.cdiv(M, rows_per)
    part = torch.empty((splits, N), dtype=torch.float32, device=x.device)
    _wgrad_kernel[(col_blocks, splits)](g2, x2, r, part, M, N, rows_per, BLOCK_M=BLOCK_M,
                                        BLOCK_N=BLOCK_N, num_warps=4)
    return part.sum(0)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, eps)
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, w,
                                                         [True, False])[0]
        dw = weight_grad(grad, x, rstd).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def supported(x: torch.Tensor, w: torch.Tensor | None) -> bool:
    """A weight of x's last dimension and dtype that trains, x contiguous."""
    return (w is not None and w.requires_grad and w.dim() == 1 and w.shape[0] == x.shape[-1]
            and w.dtype == x.dtype and x.is_contiguous())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """RMSNorm of x over its last dimension by w; on CUDA with grad, the weight gradient on the
    Triton kernel (see `supported`), everything else torch's."""
    if not use_triton(x, impl) or not x.is_cuda or not supported(x, w) \
            or not torch.is_grad_enabled():
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return _RMSNorm.apply(x, w, eps)
