"""The training passes' RMSNorm backward as one Triton pass over the rows
(parallel.norm_backward=triton; models/build.py TritonBackwardRMSNorm).

torch's RMSNorm backward on CUDA runs two kernels per norm: the input gradient, then the weight
gradient as a column reduction over every row, which the H100 update profile put at about three
times its memory traffic. Here one kernel reads each row of x and of the output gradient once and
writes the input gradient, while each program sums its rows' share of the weight gradient in fp32
registers; a (programs, N) fp32 buffer of those sums is reduced after it (a few hundred rows).
The forward stays torch's fused `F.rms_norm` (at its memory traffic already); 1 / rms is made again
per row in the backward from x, which the kernel reads anyway, so nothing more is saved.

`rms_norm(x, weight, eps)`: y = x / sqrt(mean(x^2) + eps) * weight over the last dimension,
differentiable in x and weight. Backward, per row, in fp32: r = rsqrt(mean(x^2) + eps),
xh = x * r, wg = g * weight, dx = r * (wg - xh * mean(wg * xh)), dweight = sum over rows of g * xh.
`impl` as in kernels/_dispatch.use_triton; the twin is torch's own backward.
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
    def _bwd_kernel(x_ptr, g_ptr, w_ptr, dx_ptr, part_ptr, M, N, eps, ROWS_PER_PROG,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        first = pid * ROWS_PER_PROG
        for start in range(first, first + ROWS_PER_PROG, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & cmask[None, :]
            off = rows.to(tl.int64)[:, None] * N + cols[None, :]
            x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
            xh = x * r[:, None]
            wg = g * w[None, :]
            c = tl.sum(wg * xh, axis=1) / N
            dx = r[:, None] * (wg - xh * c[:, None])
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += tl.sum(g * xh, axis=0)
        tl.store(part_ptr + pid * N + cols, dw, mask=cmask)


@functools.cache
def _programs(device_index: int) -> int:
    if interpreting() or not torch.cuda.is_available():
        return 4
    return 4 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float):
    N = x.shape[-1]
    x2, g2 = x.reshape(-1, N), g.reshape(-1, N)
    M = x2.shape[0]
    if M == 0:
        return torch.empty_like(x), torch.zeros_like(w)
    dx = torch.empty_like(x2)
    block_n = triton.next_power_of_2(N)
    block_m = max(1, min(16, 4096 // block_n))
    rows_per = triton.cdiv(triton.cdiv(M, _programs(x.device.index or 0)), block_m) * block_m
    progs = max(1, triton.cdiv(M, rows_per))
    part = torch.empty((progs, N), dtype=torch.float32, device=x.device)
    _bwd_kernel[(progs,)](x2, g2, w, dx, part, M, N, eps, rows_per, BLOCK_M=block_m,
                          BLOCK_N=block_n, num_warps=8 if block_n >= 1024 else 4)
    return dx.view(x.shape), part.sum(0).to(w.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        dx, dw = _backward(x, grad.contiguous(), w, ctx.eps)
        return dx, dw, None


def supported(x: torch.Tensor, w: torch.Tensor | None) -> bool:
    """A weight of x's last dimension and dtype, x contiguous."""
    return (w is not None and w.dim() == 1 and w.shape[0] == x.shape[-1] and w.dtype == x.dtype
            and x.is_contiguous())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """RMSNorm of x over its last dimension by w; the backward on the Triton kernel where it
    applies (see `supported`), else torch's."""
    if not use_triton(x, impl) or not supported(x, w) or not torch.is_grad_enabled():
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return _RMSNorm.apply(x, w, eps)
