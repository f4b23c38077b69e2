"""The training passes' RoPE (rotate-half, the whole head) as one Triton kernel each way
(models/fused.py installs it in place of Megatron's bshd RoPE where `supported`).

`rope(t, cos, sin)`: t (S, B, H, D) (q or k: a strided view of the QKV projection, the last
dimension contiguous), or q as the projection groups it, (S, B, G, H / G, D) (a view: what
`parallel.rope_from_qkv` hands over instead of Megatron's reshaped copy to (S, B, H, D)); cos / sin
(S, 1, 1, D) in t's dtype (models/fused._RopeTables). Returns (S, B, H, D)
t * cos + cat(-t2, t1) * sin, contiguous, computed in fp32 and rounded once (as inductor's fused
kernel of the same formula does). Its backward is the inverse rotation of the output gradient
by the same tables: dt1 = g1 * cos1 + g2 * sin2, dt2 = g2 * cos2 - g1 * sin1.

Each program rotates BLOCK_R positions x every head (padded to a power of two) x both halves of
head_dim: the two halves of a head are two loads of contiguous D / 2 elements, the tables' rows
are read once per position for all heads. `rope_twin` is the PyTorch formula (eager
bf16 rounding; the tests compare both to fp32), which models/fused.py compiles for the head sizes
the kernel does not take. `impl` as in kernels/_dispatch.use_triton.
"""

from __future__ import annotations

import torch

from ._dispatch import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(t_ptr, cos_ptr, sin_ptr, out_ptr, rows, B, H, HPG,
                     st_s, st_b, st_g, st_h, so_s, so_b, so_h,
                     BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, HP: tl.constexpr,
                     D2: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # (s, b) positions, b fastest
        h = tl.arange(0, HP)
        d = tl.arange(0, D2)
        s, b = r // B, r % B
        mask = (r < rows)[:, None, None] & (h < H)[None, :, None]
        # head h of t: head h % HPG of group h // HPG (a 4-D t: one group of all H heads)
        t_head = (h // HPG) * st_g + (h % HPG) * st_h
        t_off = (s * st_s + b * st_b)[:, None, None] + t_head[None, :, None] + d[None, None, :]
        o_off = (s * so_s + b * so_b)[:, None, None] + (h * so_h)[None, :, None] + d[None, None, :]
        tab = (s * (2 * D2))[:, None, None] + d[None, None, :]
        rmask = (r < rows)[:, None, None]
        c1 = tl.load(cos_ptr + tab, mask=rmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tab + D2, mask=rmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tab, mask=rmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tab + D2, mask=rmask, other=0.0).to(tl.float32)
        x1 = tl.load(t_ptr + t_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(t_ptr + t_off + D2, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(out_ptr + o_off, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + o_off + D2, y2.to(out_ptr.dtype.element_ty), mask=mask)


def supported(t: torch.Tensor, cos: torch.Tensor) -> bool:
    """Shapes the kernel takes: t 4-D (or 5-D, heads in groups) with a contiguous even head_dim
    whose half is a power of two, cos / sin one contiguous row of head_dim per position of t."""
    if t.dim() not in (4, 5) or t.stride(-1) != 1 or t.shape[-1] % 2:
        return False
    half = t.shape[-1] // 2
    return (half & (half - 1)) == 0 and cos.shape == (t.shape[0], 1, 1, t.shape[-1]) \
        and cos.is_contiguous()


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """(S, B, H, D), contiguous: t (S, B, H, D) or (S, B, G, H / G, D) rotated."""
    S, B, D = t.shape[0], t.shape[1], t.shape[-1]
    if t.dim() == 5:
        G, hpg = t.shape[2], t.shape[3]
        st_g, st_h = t.stride(2), t.stride(3)
    else:
        G, hpg = 1, t.shape[2]
        st_g, st_h = 0, t.stride(2)
    H = G * hpg
    out = torch.empty((S, B, H, D), dtype=t.dtype, device=t.device)
    rows = S * B
    if rows == 0:
        return out
    hp = triton.next_power_of_2(H)
    block_r = max(1, min(64, 2048 // (hp * (D // 2))))
    grid = (triton.cdiv(rows, block_r),)
    _rope_kernel[grid](t, cos, sin, out, rows, B, H, hpg, t.stride(0), t.stride(1), st_g, st_h,
                       out.stride(0), out.stride(1), out.stride(2), BACKWARD=backward,
                       BLOCK_R=block_r, HP=hp, D2=D // 2, num_warps=4)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.t_shape = t.shape
        return _rotate(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rotate(grad, cos, sin, backward=True).view(ctx.t_shape), None, None


def heads(t: torch.Tensor) -> torch.Tensor:
    """(S, B, H, D): a grouped q (S, B, G, H / G, D) reshaped as Megatron reshapes it (a copy
    where G > 1); a 4-D t itself."""
    return t.reshape(*t.shape[:2], -1, t.shape[-1]) if t.dim() == 5 else t


def rope_twin(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's bshd RoPE given its tables, in PyTorch (the reference); a grouped 5-D t is
    reshaped to (S, B, H, D) first (`heads`), as Megatron does."""
    t = heads(t)
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """RoPE of t (S, B, H, D) or (S, B, G, H / G, D) by the tables (S, 1, 1, D) -> (S, B, H, D);
    differentiable in t."""
    if not use_triton(t, impl) or not supported(t, cos):
        return rope_twin(t, cos, sin)
    return _Rope.apply(t, cos, sin)
