"""EXPERIMENT, not used by the product: fused decode GEMMs in Triton, with a PyTorch twin.

Result (benchmarks/results/fused_linear_h200.json, benchmarks/bench_fused_linear.py, one H200):
cuBLAS wins. At Qwen2-1.5B / 64 rows the four fused kernels of a layer took 71.5 us against 58.7 us
for today's compiled parts (cuBLAS GEMMs + inductor's norm / SwiGLU kernels); at Qwen2-0.5B / 256
rows 77.7 against 44.6 us. fc1 + SwiGLU alone: 37.8 us against cuBLAS's bare fc1 18.8 us (1.5B/64).
Triton's tl.dot tiles at these skinny shapes (an A tile as large as a W tile) do not reach cuBLAS's
bandwidth, and the folded-in kernels (~3 us each) do not pay for it. Kept so that a later Triton
(TMA / warp-specialised matmul) can be tried with one command.

A decode step of Qwen2-1.5B at batch 64 spends ~2.0 ms in ~356 kernels, 12-13 per layer
(benchmarks/results/decode_profile_h200_wall.json): RMSNorm, the QKV GEMM, the output projection,
RMSNorm again, fc1, the SwiGLU element-wise kernel, fc2 and cuBLAS's split-K reduce, each small
kernel ~3 us. `fused_linear` does one GEMM with its neighbours folded in, so a layer's MLP and
projections are four kernels:

    out = residual + act(rmsnorm(a; norm_weight) @ w.T + bias)

- `norm_weight`: RMSNorm of the rows of `a` first. Since rmsnorm(a) @ w.T = rstd * ((a * g) @ w.T)
  with rstd = rsqrt(mean(a^2) + eps) a per-row scalar, the kernel multiplies each A tile by g as it
  streams K, sums a^2 on the way and scales the accumulator at the end: no normalised copy of `a`.
- `swiglu`: w holds [gate; up] (2F rows, Megatron's fc1 layout); the output (M, F) is
  silu(gate) * up, both halves accumulated by the same program (no (M, 2F) intermediate).
- `residual`: added in fp32 to the product, rounded once (as cuBLAS's addmm with beta = 1).
- split-K (`SPLIT` > 1): at decode's few rows an A tile is as large as a W tile, so tiles must be
  wide (BLOCK_N >= 128: A is re-read once per N tile) and then too few to fill the device; SPLIT
  programs share each tile's K instead. Each stores its fp32 partial(s) (and its share of a^2) and
  bumps the tile's counter; the last to arrive sums the partials in a fixed order (deterministic)
  and runs the epilogue (norm scale, bias, SwiGLU, residual), then resets the counter for the
  next launch (CUDA-graph replays included). No separate reduce kernel.

Rounding differs from the unfused ops in the bf16 products (a * g is rounded, not a * rstd * g; the
gate and up halves are rounded before the SwiGLU as F.linear rounds them), so the twin is the math,
not bit equality: tests compare fp32 runs (TRITON_INTERPRET=1 on CPU) and bf16 within tolerance.

Tile sizes: passed by the benchmark (`cfg`); DEFAULT otherwise.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from hybridflow.kernels._dispatch import HAVE_TRITON, use_triton
# the split-K tile counters: the product's (zero between launches, each kernel resets its own)
from hybridflow.kernels.gemm import MAX_TILES, _locks

if HAVE_TRITON:
    import triton
    import triton.language as tl


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int


if HAVE_TRITON:

    @triton.jit
    def _fused_linear_kernel(a_ptr, g_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, ss_ptr,
                             lock_ptr, M, N, K, UP, eps, s_am, s_wn, s_rm, s_om,
                             NORM: tl.constexpr, SWIGLU: tl.constexpr, BIAS: tl.constexpr,
                             RES: tl.constexpr, SPLIT: tl.constexpr, K_ITERS: tl.constexpr,
                             BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        ss = tl.zeros([BLOCK_M], tl.float32)
        k0 = split * K_ITERS * BLOCK_K
        for i in range(0, K_ITERS):  # a constexpr trip count (Triton's interpreter needs one)
            rk = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            a = tl.load(a_ptr + rm[:, None].to(tl.int64) * s_am + rk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                af = a.to(tl.float32)
                ss += tl.sum(af * af, 1)
                gk = tl.load(g_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
                a = (af * gk[None, :]).to(a_ptr.dtype.element_ty)
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + rk[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
            if SWIGLU:
                wu = tl.load(w_ptr + (rn[:, None] + UP).to(tl.int64) * s_wn + rk[None, :],
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc_up = tl.dot(a, tl.trans(wu), acc_up)
        last = True
        if SPLIT > 1:  # store this split's share; the last program of the tile finishes it
            tile = pid_m * tl.num_programs(1) + pid_n
            tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            offs = (tile * SPLIT + split).to(tl.int64) * (1 + SWIGLU) * BLOCK_M * BLOCK_N
            tl.store(part_ptr + offs + tile_offs, acc)
            if SWIGLU:
                tl.store(part_ptr + offs + BLOCK_M * BLOCK_N + tile_offs, acc_up)
            if NORM:
                tl.store(ss_ptr + (tile * SPLIT + split) * BLOCK_M + tl.arange(0, BLOCK_M), ss)
            tl.debug_barrier()  # every thread's stores are issued before the release below
            count = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            last = count == SPLIT - 1
            if last:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                ss = tl.zeros([BLOCK_M], tl.float32)
                for s in range(0, SPLIT):  # fixed order: the same sum whichever program is last
                    offs = (tile * SPLIT + s).to(tl.int64) * (1 + SWIGLU) * BLOCK_M * BLOCK_N
                    acc += tl.load(part_ptr + offs + tile_offs, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(part_ptr + offs + BLOCK_M * BLOCK_N + tile_offs,
                                          cache_modifier=".cg")
                    if NORM:
                        ss += tl.load(ss_ptr + (tile * SPLIT + s) * BLOCK_M
                                      + tl.arange(0, BLOCK_M), cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
        if last:
            if NORM:
                rstd = 1.0 / tl.sqrt(ss / K + eps)
                acc = acc * rstd[:, None]
                acc_up = acc_up * rstd[:, None]
            if BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:  # gate and up rounded as F.linear returns them, the SwiGLU in fp32
                gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
                up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
                acc = gate / (1.0 + tl.exp(-gate)) * up
            mask = m_ok[:, None] & n_ok[None, :]
            if RES:
                acc += tl.load(res_ptr + rm[:, None].to(tl.int64) * s_rm + rn[None, :], mask=mask,
                               other=0.0).to(tl.float32)
            tl.store(out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)


# kinds: "norm" (QKV: norm + bias), "swiglu" (fc1), "res" (fc2, the output projection)
DEFAULT = {"norm": Config(64, 64, 64, 4, 4, 4), "swiglu": Config(64, 128, 64, 2, 4, 4),
           "res": Config(64, 64, 128, 4, 4, 3)}
def fused_linear(a: torch.Tensor, w: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None,
                 eps: float = 1e-6, bias: Optional[torch.Tensor] = None,
                 residual: Optional[torch.Tensor] = None, swiglu: bool = False,
                 cfg: Optional[Config] = None, impl: str = "auto") -> torch.Tensor:
    """residual + act(rmsnorm(a) @ w.T + bias) for a (M, K), w (N, K) or, with swiglu, (2F, K) ->
    (M, N) / (M, F) in a's dtype. Optional parts are skipped when None / False."""
    M, K = a.shape
    if w.shape[1] != K:
        raise ValueError(f"fused_linear: a has K={K} columns, w has shape {tuple(w.shape)}")
    if swiglu and w.shape[0] % 2:
        raise ValueError(f"fused_linear(swiglu=True): w has {w.shape[0]} rows, expected [gate; up]")
    N = w.shape[0] // 2 if swiglu else w.shape[0]
    if not use_triton(a, impl):
        return _fused_linear_torch(a, w, norm_weight=norm_weight, eps=eps, bias=bias,
                                   residual=residual, swiglu=swiglu)
    if a.stride(-1) != 1 or w.stride(-1) != 1 or (residual is not None
                                                  and residual.stride(-1) != 1):
        raise ValueError("fused_linear needs a, w and residual contiguous in the last dimension")
    kind = "swiglu" if swiglu else ("res" if residual is not None else "norm")
    c = cfg or DEFAULT[kind]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, c.block_m), triton.cdiv(N, c.block_n), c.split)
    k_iters = triton.cdiv(triton.cdiv(K, c.split), c.block_k)  # BLOCK_K steps per split
    if c.split > 1:
        tiles = grid[0] * grid[1]
        if tiles > MAX_TILES:
            raise ValueError(f"fused_linear: {tiles} output tiles exceed the {MAX_TILES} counters")
        part = torch.empty(tiles * c.split * (1 + swiglu) * c.block_m * c.block_n,
                           dtype=torch.float32, device=a.device)
        ss = torch.empty(tiles * c.split * c.block_m, dtype=torch.float32, device=a.device)
        locks = _locks(a.device)
    else:
        part = ss = locks = out  # unused
    res = residual if residual is not None else out
    _fused_linear_kernel[grid](
        a, norm_weight if norm_weight is not None else a, w, bias if bias is not None else a, res,
        out, part, ss, locks, M, N, K, N, float(eps), a.stride(0), w.stride(0),
        res.stride(0), out.stride(0), NORM=norm_weight is not None, SWIGLU=swiglu,
        BIAS=bias is not None, RES=residual is not None, SPLIT=c.split, K_ITERS=k_iters,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.warps,
        num_stages=c.stages)
    return out


def _fused_linear_torch(a, w, *, norm_weight, eps, bias, residual, swiglu):
    h = a if norm_weight is None else F.rms_norm(a, (a.shape[-1],), norm_weight, eps)
    if residual is not None and bias is None and not swiglu and h.dim() == 2:
        return torch.addmm(residual, h, w.t())
    z = F.linear(h, w, bias)
    if swiglu:
        gate, up = z.chunk(2, dim=-1)
        z = F.silu(gate) * up
    return z if residual is None else residual + z
