"""fc1 + SwiGLU of the decode layer as one Triton GEMM (rollout.decode_kernels=triton).

`swiglu_linear(h, fc1)`: h (M, D), fc1 (2F, D) = [gate; up] (Megatron's fc1 layout, per TP shard)
-> silu(h @ gate^T) * (h @ up^T) (M, F) without the (M, 2F) product: program (m tile, n tile)
accumulates the gate tile (fc1 rows n..) and the up tile (rows F + n..) over the same A tiles,
rounds both to h's dtype (as F.linear returns them), takes the SiLU in fp32 rounded to the dtype
and the product rounded once: what `kernels.layer_ops.silu_mul` does to F.linear's output, up to
the GEMM's summation order. A plain tiled GEMM (operands straight from memory into tl.dot,
software-pipelined), the SwiGLU in the epilogue only: it saves cuBLAS's separate SwiGLU kernel and
the write and re-read of the (M, 2F) product. Other decode GEMMs stay on cuBLAS (docs/perf_log.md
says which Triton variants were measured and lost).

Tiles: a `Config` per call, or `config_for(M)` from CONFIGS (tuned by
benchmarks/bench_triton_gemm.py). `impl`: "auto" (Triton on CUDA tensors), "triton" (on CPU only
under TRITON_INTERPRET=1), "torch" (F.linear + the SwiGLU: the twin).
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


# [(rows at most, config)]: the first entry whose bound holds M; the best of an H200 sweep at 256
# rows (a decode batch) and at 16k (a prefill sub-batch)
CONFIGS = ((512, Config(64, 64, 64, 4, 3)), (1 << 62, Config(128, 64, 64, 8, 3)))


def config_for(M: int) -> Config:
    return next(c for bound, c in CONFIGS if M <= bound)


if HAVE_TRITON:

    @triton.jit
    def _swiglu_kernel(a_ptr, w_ptr, out_ptr, pf_ptr, pf_bytes, M, N, K, s_am, s_wn, s_om,
                       K_ITERS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       IEEE: tl.constexpr, PREFETCH: tl.constexpr = False,
                       PDL: tl.constexpr = False):
        pid = tl.program_id(0)
        if PREFETCH:  # the next GEMM's weights into L2 while this one runs
            prefetch_l2(pf_ptr, pf_bytes, pid, tl.num_programs(0))
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
        rk = tl.arange(0, BLOCK_K)
        # out-of-range rows / columns read row 0 (kept out by the store's mask): unmasked loads
        rm_in = tl.where(rm < M, rm, 0).to(tl.int64)
        rn_in = tl.where(rn < N, rn, 0).to(tl.int64)
        a_ptrs = a_ptr + rm_in[:, None] * s_am + rk[None, :]
        w_ptrs = w_ptr + rn_in[None, :] * s_wn + rk[:, None]  # (BLOCK_K, BLOCK_N) of gate^T
        u_ptrs = w_ptrs + N * s_wn  # the up half's rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in range(0, K_ITERS):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
                u = tl.load(u_ptrs)
            else:
                k_ok = rk < K - i * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
            if IEEE:  # fp32 inputs: full-precision products (the default would be TF32)
                acc = tl.dot(a, w, acc, input_precision="ieee")
                acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
                acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        dt = out_ptr.dtype.element_ty
        gate = acc.to(dt).to(tl.float32)  # as F.linear rounds its output
        up = acc_u.to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # as F.silu rounds
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :], (act * up).to(dt),
                 mask=mask)


def swiglu_linear(h: torch.Tensor, fc1: torch.Tensor, *, cfg: Optional[Config] = None,
                  prefetch: Optional[torch.Tensor] = None, pdl: bool = False,
                  impl: str = "auto") -> torch.Tensor:
    """silu(h @ gate^T) * (h @ up^T) for fc1 = [gate; up] (2F, D), h (M, D) -> (M, F) in h's
    dtype; both contiguous in the last dimension. `prefetch`: a tensor (the next GEMM's weight)
    the kernel hints into L2 (sm_90+; kernels/_dispatch.prefetch_l2)."""
    if h.dim() != 2 or fc1.dim() != 2 or h.shape[1] != fc1.shape[1]:
        raise ValueError(f"swiglu_linear: h {tuple(h.shape)} and fc1 {tuple(fc1.shape)} are not "
                         f"(M, K) and (2F, K)")
    if fc1.shape[0] % 2:
        raise ValueError(f"swiglu_linear: fc1 has {fc1.shape[0]} rows, expected [gate; up] (even)")
    if not use_triton(h, impl):
        gate, up = F.linear(h, fc1).chunk(2, dim=-1)
        return F.silu(gate) * up
    if h.stride(-1) != 1 or fc1.stride(-1) != 1:
        raise ValueError("swiglu_linear needs h and fc1 contiguous in the last dimension")
    (M, K), f = h.shape, fc1.shape[0] // 2
    out = torch.empty((M, f), dtype=h.dtype, device=h.device)
    cfg = cfg or config_for(M)
    if M and f:
        k_iters = triton.cdiv(K, cfg.block_k)
        pf, pf_bytes, pf_on = prefetch_args(h, prefetch)
        _swiglu_kernel[(triton.cdiv(M, cfg.block_m) * triton.cdiv(f, cfg.block_n),)](
            h, fc1, out, pf, pf_bytes, M, f, K, h.stride(0), fc1.stride(0), out.stride(0),
            K_ITERS=k_iters, EVEN_K=K == k_iters * cfg.block_k, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            IEEE=h.dtype == torch.float32, PREFETCH=pf_on, num_warps=cfg.warps,
            num_stages=cfg.stages, **launch_opts(h, pdl))
    return out
