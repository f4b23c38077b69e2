"""The decode layer's GEMMs in Triton with their neighbours in the epilogue: fc1 + SwiGLU, QKV + bias,
the attention output projection accumulated into the residual.

- `swiglu_linear(h, fc1)`: h (M, D), fc1 (2F, D) = [gate; up] (Megatron's fc1 layout, per TP
  shard) -> silu(h @ gate^T) * (h @ up^T) (M, F) without the (M, 2F) product: program (m tile,
  n tile) accumulates the gate tile (fc1 rows n..) and the up tile (rows F + n..) over the same A
  tiles, rounds both to h's dtype (as F.linear returns them), takes the SiLU in fp32 rounded to
  the dtype and the product rounded once: what `kernels.layer_ops.silu_mul` does to F.linear's output,
  up to the GEMM's summation order.
- `linear(a, w, bias=None, out=None)`: a @ w^T (+ bias, added in fp32 and rounded once, as
  cuBLAS's bias epilogue); with `out`, accumulated into it in place (out + a @ w^T in fp32, rounded
  once: cuBLAS's addmm with beta = 1). With `Config.split` > 1 (split-K, for fc2's long K over few
  output tiles) each of a tile's `split` programs stores its fp32 share and bumps the tile's
  counter; the last to arrive sums the shares in split order (deterministic) and runs the
  epilogue, then resets the counter: no second reduce kernel (cuBLAS's fc2 runs one).

Why: inside a decode step of Qwen2-0.5B at batch 256, cuBLAS's fc1 takes 11.1 us per layer and the
SwiGLU kernel after it 2.3 us, reading the 5 MB (M, 2F) product back; the QKV GEMM with bias 5.4 us,
the projection 5.0 us for ~0.5 GFLOP each (benchmarks/results/decode_profile_h200_fused_layer.json).
fc1 + SwiGLU as one Triton GEMM took 0.4452 -> 0.4318 s off a 256-row, 256-token generate call
(benchmarks/results/swiglu_gemm_h200.json, generate_h200_decode_ab.json). An earlier experiment
(benchmarks/fused_linear_triton.py) lost to cuBLAS with the RMSNorm folded into the A tiles and
split-K partials; these are plain tiled GEMMs (operands straight from memory into tl.dot,
software-pipelined), the neighbours in the epilogue only.

Tiles: a `Config` per call, or `config_for(kind, M)` from CONFIGS (measured by
benchmarks/bench_triton_gemm.py). `impl`: "auto" (Triton on CUDA tensors), "triton" (on CPU only
under TRITON_INTERPRET=1), "torch" (the PyTorch ops they replace).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ._dispatch import HAVE_TRITON, launch_opts, prefetch_args, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ._dispatch import pdl_enter, prefetch_l2


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8
    split: int = 1  # split-K: programs sharing a tile's K (linear only), reduced in the kernel


# kind -> [(rows at most, config)]: the first entry whose bound holds M. swiglu: the H200 sweep's
# best at 256 rows (decode) and 16k (a prefill sub-batch), benchmarks/results/swiglu_gemm_h200.json
CONFIGS = {
    "swiglu": [(512, Config(64, 64, 64, 4, 3)), (1 << 62, Config(128, 64, 64, 8, 3))],
    "linear": [(512, Config(64, 64, 64, 4, 3)), (1 << 62, Config(128, 128, 64, 8, 3))],
    # fc2's long K (the FFN width) over few output tiles at decode's rows: split-K (a guess until
    # an H200 sweep, bench_triton_gemm.py --gemms fc2)
    "linear_long_k": [(512, Config(64, 64, 64, 4, 3, 8, 4)), (1 << 62, Config(128, 128, 64, 8, 3))],
}
MAX_TILES = 1 << 14  # split-K tile counters kept per device


def config_for(kind: str, M: int) -> Config:
    return next(c for bound, c in CONFIGS[kind] if M <= bound)


if HAVE_TRITON:

    @triton.jit
    def _gemm_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, pf_ptr, pf_bytes, M, N,
                     K, s_am, s_wn, s_om, K_ITERS: tl.constexpr, EVEN_K: tl.constexpr,
                     SWIGLU: tl.constexpr, BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
                     PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False):
        pid = tl.program_id(0)
        split = tl.program_id(1)  # K_ITERS blocks of K from split * K_ITERS * BLOCK_K
        if PREFETCH:  # the next GEMM's weights into L2 while this one runs
            prefetch_l2(pf_ptr, pf_bytes, pid * SPLIT + split, tl.num_programs(0) * SPLIT)
        pdl_enter(PDL)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        # grouped order: GROUP_M m tiles walk the n tiles together (their W tiles shared in L2)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = split * K_ITERS * BLOCK_K
        rk = tl.arange(0, BLOCK_K)
        # out-of-range rows / columns read row 0 (kept out by the store's mask): unmasked loads
        rm_in = tl.where(rm < M, rm, 0).to(tl.int64)
        rn_in = tl.where(rn < N, rn, 0).to(tl.int64)
        a_ptrs = a_ptr + rm_in[:, None] * s_am + (k0 + rk)[None, :]
        w_ptrs = w_ptr + rn_in[None, :] * s_wn + (k0 + rk)[:, None]  # (BLOCK_K, BLOCK_N) of W^T
        u_ptrs = w_ptrs + N * s_wn  # SwiGLU: the up half's rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in range(0, K_ITERS):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = rk < K - k0 - i * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if IEEE:  # fp32 inputs: full-precision products (the default would be TF32)
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            if SWIGLU:
                if EVEN_K:
                    u = tl.load(u_ptrs)
                else:
                    u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
                if IEEE:
                    acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
                else:
                    acc_u = tl.dot(a, u, acc_u)
                u_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        last = True
        if SPLIT > 1:  # this split's fp32 share; the tile's last program to arrive sums them
            tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(part_ptr + (pid * SPLIT + split).to(tl.int64) * BLOCK_M * BLOCK_N + tile_offs,
                     acc)
            tl.debug_barrier()  # every thread's share is stored before the release below
            last = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel") == SPLIT - 1
            if last:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(0, SPLIT):  # in split order, whichever program arrives last
                    acc += tl.load(part_ptr + (pid * SPLIT + s).to(tl.int64) * BLOCK_M * BLOCK_N
                                   + tile_offs, cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + pid, 0)  # ready for the next launch (graph replays too)
        if last:
            dt = out_ptr.dtype.element_ty
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            o_ptrs = out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :]
            if BIAS:
                acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                gate = acc.to(dt).to(tl.float32)  # as F.linear rounds its output
                up = acc_u.to(dt).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # as F.silu rounds
                acc = act * up
            if ACCUMULATE:
                acc += tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_ptrs, acc.to(dt), mask=mask)


_LOCKS: dict = {}


def _locks(device: torch.device) -> torch.Tensor:
    """The split-K tile counters of `device`: zero between launches (the last program of a tile
    resets its counter), made once, before any CUDA-graph capture (a decode step's warm-up)."""
    t = _LOCKS.get(device)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernels.gemm: the split-K counters must be made before CUDA-graph "
                               "capture (run the step once eagerly first)")
        t = _LOCKS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return t


def _launch(a, w, bias, out, n: int, *, swiglu: bool, accumulate: bool, cfg: Config,
            prefetch: Optional[torch.Tensor] = None) -> None:
    M, K = a.shape
    if M and n:
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        k_iters = triton.cdiv(triton.cdiv(K, cfg.split), cfg.block_k)  # BLOCK_K steps per split
        part = locks = out  # unused without split-K
        if cfg.split > 1:
            if swiglu or tiles > MAX_TILES:
                raise ValueError(f"kernels.gemm: split-K {cfg.split} needs a plain linear of at most "
                                 f"{MAX_TILES} output tiles (swiglu={swiglu}, {tiles} tiles)")
            part = torch.empty(tiles * cfg.split * cfg.block_m * cfg.block_n, dtype=torch.float32,
                               device=a.device)
            locks = _locks(a.device)
        pf, pf_bytes, pf_on = prefetch_args(a, prefetch)
        _gemm_kernel[(tiles, cfg.split)](
            a, w, out if bias is None else bias, out, part, locks, pf, pf_bytes, M, n, K,
            a.stride(0), w.stride(0), out.stride(0), K_ITERS=k_iters, PREFETCH=pf_on,
            EVEN_K=K == cfg.split * k_iters * cfg.block_k, SWIGLU=swiglu, BIAS=bias is not None,
            ACCUMULATE=accumulate, SPLIT=cfg.split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, IEEE=a.dtype == torch.float32,
            num_warps=cfg.warps, num_stages=cfg.stages, **launch_opts(a))


def _check(name: str, a: torch.Tensor, w: torch.Tensor) -> None:
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: a {tuple(a.shape)} and w {tuple(w.shape)} are not (M, K) and "
                         f"(N, K)")


def swiglu_linear(h: torch.Tensor, fc1: torch.Tensor, *, cfg: Optional[Config] = None,
                  prefetch: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """silu(h @ gate^T) * (h @ up^T) for fc1 = [gate; up] (2F, D), h (M, D) -> (M, F) in h's
    dtype; both contiguous in the last dimension. `prefetch`: a tensor (the next GEMM's weight)
    the kernel hints into L2 (sm_90+; kernels/_dispatch.prefetch_l2)."""
    _check("swiglu_linear", h, fc1)
    if fc1.shape[0] % 2:
        raise ValueError(f"swiglu_linear: fc1 has {fc1.shape[0]} rows, expected [gate; up] (even)")
    if not use_triton(h, impl):
        gate, up = F.linear(h, fc1).chunk(2, dim=-1)
        return F.silu(gate) * up
    if h.stride(-1) != 1 or fc1.stride(-1) != 1:
        raise ValueError("swiglu_linear needs h and fc1 contiguous in the last dimension")
    f = fc1.shape[0] // 2
    out = torch.empty((h.shape[0], f), dtype=h.dtype, device=h.device)
    _launch(h, fc1, None, out, f, swiglu=True, accumulate=False,
            cfg=cfg or config_for("swiglu", h.shape[0]), prefetch=prefetch)
    return out


def linear(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           out: Optional[torch.Tensor] = None, cfg: Optional[Config] = None,
           kind: str = "linear", impl: str = "auto") -> torch.Tensor:
    """a @ w^T (+ bias) -> (M, N) in a's dtype; with `out` (M, N): out += a @ w^T in place (and
    returned). a, w (and out) contiguous in the last dimension. `kind`: the CONFIGS table when no
    `cfg` ("linear_long_k": split-K tiles, fc2's)."""
    _check("linear", a, w)
    if out is not None and (tuple(out.shape) != (a.shape[0], w.shape[0]) or bias is not None):
        raise ValueError(f"linear: out {tuple(out.shape)} must be (M, N) = "
                         f"{(a.shape[0], w.shape[0])}, and without a bias")
    if not use_triton(a, impl):
        return F.linear(a, w, bias) if out is None else out.addmm_(a, w.t())
    if a.stride(-1) != 1 or w.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError("linear needs a, w and out contiguous in the last dimension")
    accumulate = out is not None
    if out is None:
        out = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    _launch(a, w, bias, out, w.shape[0], swiglu=False, accumulate=accumulate,
            cfg=cfg or config_for(kind, a.shape[0]))
    return out
