"""The training passes' SwiGLU backward as one Triton kernel (models/fused.py installs it in
Megatron's fused SwiGLU, `parallel.swiglu_backward=triton`).

`swiglu_backward(g, z)`: z (N, 2F) = fc1's output [gate | up] as the forward saved it, g (N, F) the
gradient of silu(gate) * up. Returns dz (N, 2F) = [g * up * silu'(gate) | g * silu(gate)] with
silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a))), computed in fp32 and rounded once, as
inductor's kernel of Megatron's `swiglu_back` formula does. That kernel writes the concatenated
output element by element, each element loading what its half needs: g and gate twice, up once.
Here each program reads one block of g, gate and up once and writes both halves from them.

One program per (row, BLOCK columns of F); rows and F may be any size (the tail of a row is
masked). `swiglu_backward_twin` is the PyTorch formula (the CPU path and the tests' reference).
`impl` as in kernels/_dispatch.use_triton.
"""

from __future__ import annotations

import torch

from ._dispatch import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_back_kernel(g_ptr, z_ptr, dz_ptr, F, s_g, s_z, s_dz, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = col < F
        g = tl.load(g_ptr + row * s_g + col, mask=ok, other=0.0).to(tl.float32)
        a = tl.load(z_ptr + row * s_z + col, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(z_ptr + row * s_z + F + col, mask=ok, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-a))
        d_gate = g * sig * (1.0 + a * (1.0 - sig)) * b
        d_up = g * a * sig
        tl.store(dz_ptr + row * s_dz + col, d_gate.to(dz_ptr.dtype.element_ty), mask=ok)
        tl.store(dz_ptr + row * s_dz + F + col, d_up.to(dz_ptr.dtype.element_ty), mask=ok)


def supported(g: torch.Tensor, z: torch.Tensor) -> bool:
    """Shapes the kernel takes: z (N, 2F) and g (N, F) of one dtype, both contiguous in their
    last dimension."""
    return (z.dim() == 2 and g.dim() == 2 and z.shape[1] == 2 * g.shape[1]
            and z.shape[0] == g.shape[0] and z.dtype == g.dtype
            and z.stride(-1) == 1 and g.stride(-1) == 1)


def swiglu_backward_twin(g: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Megatron's `swiglu_back` in fp32, rounded once to z's dtype."""
    a, b = z.float().chunk(2, dim=-1)
    g = g.float()
    sig = torch.sigmoid(a)
    return torch.cat((g * sig * (1 + a * (1 - sig)) * b, g * a * sig), dim=-1).to(z.dtype)


def swiglu_backward(g: torch.Tensor, z: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """dz (N, 2F) of silu(gate) * up for z = [gate | up] (N, 2F) and its output gradient g (N, F)."""
    if not supported(g, z):
        raise ValueError(f"swiglu_backward: z {tuple(z.shape)} {z.dtype} and g {tuple(g.shape)} "
                         f"{g.dtype}: expected z (N, 2F), g (N, F), one dtype, the last dimension "
                         "contiguous")
    if not use_triton(z, impl):
        return swiglu_backward_twin(g, z)
    n, f = g.shape
    dz = torch.empty((n, 2 * f), dtype=z.dtype, device=z.device)
    if n and f:
        block = min(1024, triton.next_power_of_2(f))
        _swiglu_back_kernel[(n, triton.cdiv(f, block))](g, z, dz, f, g.stride(0), z.stride(0),
                                                        dz.stride(0), BLOCK=block, num_warps=4)
    return dz
