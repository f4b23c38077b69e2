"""The quantized rollout's kernels (rollout.quantization): weight-only GEMMs (int4, fp8 codes) and
the fp8 per-token activation quantization, each with its PyTorch twin.

`int4_linear(x, qweight, scales, mins)`: x (M, K) in the model dtype; the weight (N, K) stored
AWQ-style as 4-bit codes packed eight to an int32 along K (`qweight` (N, K / 8): code k of row n
in word k // 8, bits 4 * (k % 8)), with one scale and one offset per group of GROUP = 128 columns
(`scales`, `mins` (N, K / GROUP), the model dtype): w[n, k] = q[n, k] * scale + min. The kernel
reads the packed codes (a quarter of the bf16 bytes) as each output row's contiguous words,
dequantizes each (BLOCK_N, BLOCK_K) tile in registers (fp32 math, rounded to x's dtype: exactly
the twin's dequantized weight) and feeds tl.dot with its transpose; no bf16 copy of the weight is
written. It dequantizes the weight once per BLOCK_M rows, so more than `kernel_max_rows` rows (a
prefill) instead dequantize it once into a temporary (`dequantize_int4`'s kernel) for F.linear.
`fp8_weight_only_linear(x, codes, scales)`: the same kernel over E4M3 codes (N, K) widened to x's
dtype (exact), the per-output-channel scale applied to the sum.
Both take a bias and a `residual` added in the epilogue (in place: the decode's residual stream,
as cuBLAS's beta = 1 does for the bf16 weights). Decode's few rows give few output tiles for the
narrow GEMMs (proj, fc2): `config_for` splits K over more programs then, their fp32 partials
summed (+ bias, + residual) by one more kernel, so the weight streams from every SM.

`quant_rows_fp8(x)`: x (M, K) -> (E4M3 codes (M, K), scales (M, 1) fp32) with per-row scale
amax / 448 (one pass over x: one launch per GEMM input, the cost decode must keep small);
torch._scaled_mm then multiplies them with row-wise weight scales (rollout/quantize.py).

`impl`: "auto" (Triton on CUDA tensors), "triton" (on CPU only under TRITON_INTERPRET=1),
"torch" (the twin).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ._dispatch import HAVE_TRITON, launch_opts, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ._dispatch import pdl_enter

GROUP = 128  # int4 columns per scale / offset (the K tile of the kernel)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


# int4 GEMMs of more rows than this (prefill) dequantize the weight once into a temporary of the
# model dtype and run cuBLAS on it: the tiled kernel dequantizes the whole weight again for every
# BLOCK_M rows, which a prefill's thousands of rows make its cost; the temporary path moves 4.5
# bytes per weight (codes in, bf16 out and back into cuBLAS), over twice bf16's 2, so decode
# buckets stay tiled (rollout.kernel_options.int4_kernel_max_rows)
KERNEL_MAX_ROWS = 256


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


def config_for(M: int, N: int, K: int, *, sms: int = 132) -> Config:
    """Tiles for an (M, K) x (K, N) weight-only GEMM, and K split until about two programs per SM
    run (decode's narrow GEMMs), at most one split per K group. Up to 32 rows: 16- or 32-row tiles,
    64 columns, 32-column K steps, 4 warps. More rows: 64-row tiles, 4 warps, 64-column K steps,
    32 columns up to 64 rows and 128 beyond: in a sweep of the tiles under CUDA graphs on an H200
    (benchmarks/results/quant_gemm_sweep_h200.json, the Qwen2 0.5B / 1.5B layer GEMMs at 64 and
    256 rows) these were the fastest for 10 of the 16 int4 GEMMs, and every fastest tile had 4
    warps (1.1-2.5x faster than the 8-warp, 32-column K steps used before)."""
    if M <= 32:
        block_m = 16 if M <= 16 else 32
        return Config(block_m, 64, 32, split_for(M, N, K, block_m, 64, sms=sms), 4, 2)
    block_n = 32 if M <= 64 else 128
    return Config(64, block_n, 64, split_for(M, N, K, 64, block_n, sms=sms), 4, 2)


def split_for(M: int, N: int, K: int, block_m: int, block_n: int, *, sms: int = 132) -> int:
    """K splits for (block_m, block_n) tiles: until about two programs per SM run, at most one
    per K group."""
    tiles = -(-M // block_m) * -(-N // block_n)
    return max(1, min(K // GROUP, -(-2 * sms // tiles)))


if HAVE_TRITON:

    @triton.jit
    def _wo_kernel(a_ptr, q_ptr, s_ptr, z_ptr, b_ptr, r_ptr, out_ptr, M, N, G, s_am, s_qn, s_sn,
                   s_rm, s_os, s_om, ITERS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
                   FP8: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   PDL: tl.constexpr = False):
        """Weight-only GEMM tile: int4 codes (FP8 False; scale + offset per K group) or E4M3 codes
        (FP8; one scale per output channel, applied to the sum) widened to a's dtype in registers.
        SPLIT: this program sums K groups g0.. of its tile into fp32 partials (reduced by
        _split_sum); else the epilogue adds the bias and the residual (r, in place: out is r)."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        pdl_enter(PDL)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rm_in = tl.where(rm < M, rm, 0).to(tl.int64)  # out-of-range rows/columns read row 0
        rn_in = tl.where(rn < N, rn, 0).to(tl.int64)
        g0 = pid_k * ITERS  # this program's K groups: g0 .. min(g0 + ITERS, G) - 1
        a_ptrs = a_ptr + rm_in[:, None] * s_am + (g0 * GROUP_K + rk)[None, :]
        # the weight tile as (BLOCK_N, BLOCK_K) rows, each row's codes contiguous: coalesced loads
        if FP8:
            q_ptrs = q_ptr + rn_in[:, None] * s_qn + (g0 * GROUP_K + rk)[None, :]
        else:  # eight codes per int32 along K: a row's BLOCK_K / 8 words, unpacked in registers
            rw = tl.arange(0, BLOCK_K // 8)
            q_ptrs = q_ptr + rn_in[:, None] * s_qn + (g0 * GROUP_K // 8 + rw)[None, :]
            shifts = tl.arange(0, 8) * 4
        sz = rn_in * s_sn + g0
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in range(0, ITERS):
            ok = g0 + i < G  # the last split may hold fewer groups: masked loads add nothing
            if not FP8:  # the group's scale and offset per output row
                s = tl.load(s_ptr + sz, mask=ok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + sz, mask=ok, other=0.0).to(tl.float32)
            for j in tl.static_range(GROUP_K // BLOCK_K):  # a group in BLOCK_K-column steps
                a = tl.load(a_ptrs, mask=ok, other=0.0)
                if FP8:
                    w = tl.load(q_ptrs, mask=ok, other=0.0).to(a.dtype)  # E4M3 values: exact
                else:
                    words = tl.load(q_ptrs, mask=ok, other=0)  # (BLOCK_N, BLOCK_K / 8)
                    # code k of a row: word k // 8, bits 4 (k % 8)
                    q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF,
                                   (BLOCK_N, BLOCK_K))
                    w = (q.to(tl.float32) * s[:, None] + z[:, None]).to(a.dtype)
                if a.dtype == tl.float32:  # fp32 (CPU tests): full-precision products
                    acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w), acc)
                a_ptrs += BLOCK_K
                q_ptrs += BLOCK_K if FP8 else BLOCK_K // 8
            sz += 1
        if FP8:  # per output channel
            acc *= tl.load(s_ptr + rn_in)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        rows = rm[:, None].to(tl.int64)
        if SPLIT:
            tl.store(out_ptr + pid_k * s_os + rows * s_om + rn[None, :], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
            if HAS_RES:
                acc += tl.load(r_ptr + rows * s_rm + rn[None, :], mask=mask).to(tl.float32)
            tl.store(out_ptr + rows * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _split_sum(p_ptr, b_ptr, r_ptr, out_ptr, M, N, s_ps, s_pm, s_rm, s_om,
                   SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
        """out = sum of the SPLITS fp32 partials (+ bias) (+ residual r), one pass."""
        pid = tl.program_id(0)
        pdl_enter(PDL)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        ok = idx < M * N
        m, n = (idx // N).to(tl.int64), idx % N
        acc = tl.zeros([BLOCK], tl.float32)
        for k in range(0, SPLITS):
            acc += tl.load(p_ptr + k * s_ps + m * s_pm + n, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(r_ptr + m * s_rm + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * s_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, s_qn, s_sn, s_on, BLOCK_N: tl.constexpr,
                        GROUP_K: tl.constexpr):
        """One (BLOCK_N, GROUP_K) tile of the int4 weight, dequantized in fp32 and rounded to the
        output's dtype: the twin's bits (with bf16 / fp16 scales q * scale is exact in fp32, so a
        fused multiply-add rounds as the twin's multiply, then add)."""
        pid_n, g = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rn < N
        rn_in = tl.where(ok, rn, 0).to(tl.int64)
        words = tl.load(q_ptr + rn_in[:, None] * s_qn + g * (GROUP_K // 8)
                        + tl.arange(0, GROUP_K // 8)[None, :])
        q = tl.reshape((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF,
                       (BLOCK_N, GROUP_K))
        s = tl.load(s_ptr + rn_in * s_sn + g).to(tl.float32)
        z = tl.load(z_ptr + rn_in * s_sn + g).to(tl.float32)
        w = q.to(tl.float32) * s[:, None] + z[:, None]
        cols = g * GROUP_K + tl.arange(0, GROUP_K)
        tl.store(out_ptr + rn_in[:, None] * s_on + cols[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=ok[:, None])

    @triton.jit
    def _fp8_rows_kernel(x_ptr, out_ptr, scale_ptr, K, s_xm, s_om, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        pdl_enter(PDL)
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, 1e-12)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(out_ptr + row * s_om + cols, q.to(out_ptr.dtype.element_ty), mask=cols < K)
        tl.store(scale_ptr + row, scale)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor, *, impl: str = "torch") -> torch.Tensor:
    """(N, K / 8) packed codes + (N, K / GROUP) scales / offsets -> the weight (N, K) in the
    scales' dtype (fp32 math, rounded once, as the kernel's tiles). `impl` as int4_linear's
    (default: the PyTorch twin)."""
    if use_triton(qweight, impl):
        return _dequantize(qweight, scales, mins)
    N, words = qweight.shape
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = ((qweight[:, :, None] >> shifts) & 0xF).reshape(N, words * 8)  # (N, K)
    w = q.view(N, -1, GROUP).float() * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(N, -1).to(scales.dtype)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None, pdl: bool = False,
                impl: str = "auto", kernel_max_rows: int = KERNEL_MAX_ROWS,
                config: Optional[Config] = None) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) for the packed int4 W (N, K) -> (M, N) in x's dtype; with
    `residual` (M, N) the product is added into it in place and it is returned. More than
    `kernel_max_rows` rows: the weight dequantized once (a temporary), then F.linear; the same
    values either way (each dequantized weight exactly the twin's). `config`: the kernel's tiles
    (default `config_for`; benchmarks/probe_quant_gemm.py --sweep times others)."""
    (M, K), N = x.shape, qweight.shape[0]
    if K % GROUP or qweight.shape[1] * 8 != K or scales.shape != (N, K // GROUP):
        raise ValueError(f"int4_linear: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)} are not (M, K), (N, K/8), (N, K/{GROUP})")
    fused = use_triton(x, impl)
    if not fused or M > kernel_max_rows:
        w = dequantize_int4(qweight, scales, mins, impl="triton" if fused else "torch")
        out = F.linear(x, w.to(x.dtype), bias)
        return out if residual is None else residual.add_(out)
    return _weight_only(x, qweight, scales, mins, bias, residual, fp8=False, pdl=pdl,
                        config=config)


def fp8_weight_only_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *,
                           bias: Optional[torch.Tensor] = None,
                           residual: Optional[torch.Tensor] = None, pdl: bool = False,
                           impl: str = "auto", config: Optional[Config] = None) -> torch.Tensor:
    """x (M, K) @ (codes * scales)^T (+ bias) for E4M3 codes (N, K) with per-output-channel fp32
    scales (1, N), the activations unquantized (the codes widened to x's dtype); `residual` and
    `config` as in int4_linear. The twin: the fp32 product of x and the codes, scaled, rounded
    once."""
    (M, K), N = x.shape, codes.shape[0]
    if K % GROUP or codes.shape[1] != K:
        raise ValueError(f"fp8_weight_only_linear: x {tuple(x.shape)}, codes {tuple(codes.shape)} "
                         f"are not (M, K), (N, K) with K a multiple of {GROUP}")
    if not use_triton(x, impl):
        out = F.linear(x.float(), codes.float()) * scales
        out = out if bias is None else out + bias.float()
        return out.to(x.dtype) if residual is None else residual.add_(out)
    return _weight_only(x, codes, scales, None, bias, residual, fp8=True, pdl=pdl, config=config)


def _weight_only(x, codes, scales, mins, bias, residual, *, fp8: bool, pdl: bool,
                 config: Optional[Config] = None):
    x = x.contiguous()
    (M, K), N = x.shape, codes.shape[0]
    cfg, groups = config or config_for(M, N, K), K // GROUP
    if GROUP % cfg.block_k or cfg.block_k % 16:
        raise ValueError(f"weight-only GEMM: block_k {cfg.block_k} must divide the group "
                         f"({GROUP}) and be a multiple of 16")
    iters = -(-groups // cfg.split_k)
    split = -(-groups // iters)  # each split: `iters` groups (the last one may have fewer)
    out = residual if residual is not None else torch.empty((M, N), dtype=x.dtype,
                                                            device=x.device)
    if not (M and N):
        return out
    flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, **launch_opts(x, pdl))
    dummy = x  # pointers of absent operands (never read: their flags are off)
    b, r = (bias if bias is not None else dummy), (residual if residual is not None else dummy)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), split)
    dst = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _wo_kernel[grid](x, codes, scales, mins if mins is not None else scales, b, r, dst, M, N,
                     groups, x.stride(0), codes.stride(0), scales.stride(0), r.stride(0),
                     dst.stride(0) if split > 1 else 0, dst.stride(-2), ITERS=iters,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_K=GROUP,
                     FP8=fp8,
                     SPLIT=split > 1, num_warps=cfg.warps, num_stages=cfg.stages, **flags)
    if split > 1:
        block = 1024
        _split_sum[(triton.cdiv(M * N, block),)](dst, b, r, out, M, N, dst.stride(0),
                                                 dst.stride(1), r.stride(0), out.stride(0),
                                                 SPLITS=split, BLOCK=block, num_warps=4, **flags)
    return out


def _dequantize(qweight, scales, mins):
    N, K = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty((N, K), dtype=scales.dtype, device=qweight.device)
    if N:
        block_n = 32  # ptxas on sm_90: 126 registers, no spills (64 rows: 255 and spills)
        _dequant_kernel[(triton.cdiv(N, block_n), K // GROUP)](
            qweight, scales, mins, out, N, qweight.stride(0), scales.stride(0), out.stride(0),
            BLOCK_N=block_n, GROUP_K=GROUP, num_warps=4)
    return out


def quant_rows_fp8(x: torch.Tensor, *, pdl: bool = False, impl: str = "auto"):
    """x (M, K) -> (codes (M, K) float8_e4m3fn, scales (M, 1) fp32): x ~ codes * scale per row,
    scale = max(amax / 448, 1e-12)."""
    if not use_triton(x, impl):
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    x = x.contiguous()
    M, K = x.shape
    out = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        _fp8_rows_kernel[(M,)](x, out, scale, K, x.stride(0), out.stride(0),
                               BLOCK=triton.next_power_of_2(K), num_warps=4 if K <= 2048 else 8,
                               **launch_opts(x, pdl))
    return out, scale
