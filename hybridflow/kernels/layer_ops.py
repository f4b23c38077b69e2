"""Fused kernels of one decode step and the prefill (rollout.decode_kernels=triton), in Triton, with
PyTorch twins.

- `add_rms_norm(x, y, weight, eps)`: the layer's residual sum + RMSNorm in one pass (optionally the
  first layer's embedding lookup too, `rows=`).
- `silu_mul(z)`: the SwiGLU of fc1's output in one pass (PyTorch runs a strided silu and a strided
  multiply).
- `rope_kv_prefill(qkv, cos, sin, k_cache, v_cache, hpg)`: the prefill's RoPE + K/V writes: one
  program per (token, KV group) reads the group's projected rows [q heads (hpg); k; v] once,
  rotates q and k (rotate-half, the signed sin table of hybridflow/rollout/decoder.rope_tables),
  writes k and v into the cache and returns the rotated queries. The twin rounds as PyTorch's
  ops round (the product x cos first, then the multiply-add).
- The q/k norm (Qwen3; `q_norm`, `k_norm` given to the RoPE kernels here and in
  kernels/rope_attention.py): before RoPE, each q head and k RMS-normed over head_dim in fp32 with
  its (hd,) weight and rounded once (`_norm_rows`; twin `qk_norm`). The rotate-half partner row is
  normed with the same factor and the weight rolled alike, so no second load is needed.
- The split-KV ("flash-decoding") attention pieces that kernels/rope_attention.py builds the
  decode step's attention from: `_attend_blocks` (one split's online softmax over its cache
  blocks: tl.dot, fp32 accumulation, masked columns -inf), `_attn_combine_kernel` (the splits'
  max / sum of exp / P @ V combined into the output) and `num_splits` (1 when the (row, group)
  programs alone fill the device, else up to one per BLOCK_T columns).
- `rope_kv_write` and `decode_attention`: the decode step's RoPE + K/V write and its attention as
  PyTorch ops, the reference twins of kernels/rope_attention.py (the decoder's eager code: SDPA
  with an additive mask; columns with key_valid false get no weight). `write_column` and
  `mark_columns`: the K/V write and the key_valid mark at one column for every row (cur (1,)) or
  a column per row (cur (B,), the multi-turn step's), static shapes. With an fp8 cache
  (kernels/kv_fp8.Fp8KV) the twins quantize what they write and dequantize what they read.

Shapes: qkv (B, G, hpg + 2, hd) (a view of the QKV projection, rows grouped per KV group as in
Megatron's packed layout); cos, sin (B, hd); k_cache, v_cache (B, G, T, hd) strided views of the KV
cache (the last dimension contiguous); key_valid (B, T) bool; q (B, G, hpg, hd); head_dim a power
of two >= 16. `impl`: "auto" takes Triton for CUDA tensors, "triton" forces it (on CPU only under
TRITON_INTERPRET=1, how the CPU tests run it), "torch" the twin. `pdl`: launch with programmatic
dependent launch where the device has it (kernels/_dispatch.launch_opts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._dispatch import HAVE_TRITON, launch_opts, prefetch_args, use_triton
from .kv_fp8 import Fp8KV, quantize_kv, readable

if HAVE_TRITON:  # CPU-only installs: the PyTorch twins serve
    import triton
    import triton.language as tl

    from ._dispatch import pdl_enter, prefetch_l2

BLOCK_T = 64  # cache columns per attention block (one tl.dot)
# the split attention kernel's launch (tuned on an H200 over the 0.5B / 1.5B decode shapes:
# docs/perf_log.md)
PROGRAMS_PER_SM = 2  # the split count aims at this many programs per SM
ATTN_WARPS, ATTN_STAGES = 4, 2

if HAVE_TRITON:

    @triton.jit
    def _norm_rows(x, xr, w, wr, eps, AXIS: tl.constexpr, HD: tl.constexpr):
        """RMSNorm over axis AXIS (HD wide) of rows x (weights' dtype) and of xr (fp32), x's
        rotate-half partner (x rolled by HD / 2): the same factor per row, weights w and wr (w
        rolled alike, fp32); computed in fp32, rounded to x's dtype once (the twin's rounding).
        Returns (x normed, xr normed as fp32)."""
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, AXIS, keep_dims=True) / HD + eps)
        return ((xf * rstd * w).to(x.dtype),
                (xr * rstd * wr).to(x.dtype).to(tl.float32))

    @triton.jit
    def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, cur_ptr, q_ptr, qn_ptr, kn_ptr,
                        eps, G, HPG, S, s_xb, s_xg, s_xr, s_cb, s_kb, s_kg, s_kt, s_vb, s_vg, s_vt,
                        s_qb, s_qg, s_qr, R_PAD: tl.constexpr, HD: tl.constexpr,
                        QK_NORM: tl.constexpr = False, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        # program (token, group); token = (cache row, position in it) = (bs // S, bs % S): S prompt
        # tokens per row, written to cache columns cur..cur + S - 1
        pid = tl.program_id(0).to(tl.int64)
        bs, g = pid // G, pid % G
        b, col = bs // S, bs % S
        r = tl.arange(0, R_PAD)[:, None]
        d = tl.arange(0, HD)[None, :]
        rows = r < HPG + 1  # the q heads and k: rotated
        base = qkv_ptr + bs * s_xb + g * s_xg
        rolled = (d + HD // 2) % HD
        x = tl.load(base + r * s_xr + d, mask=rows, other=0.0)
        xr = tl.load(base + r * s_xr + rolled, mask=rows, other=0.0).to(tl.float32)
        if QK_NORM:  # rows < HPG are q heads (q_norm), row HPG is k (k_norm)
            is_q = r < HPG
            w = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d)).to(tl.float32)
            wr = tl.where(is_q, tl.load(qn_ptr + rolled), tl.load(kn_ptr + rolled)).to(tl.float32)
            x, xr = _norm_rows(x, xr, w, wr, eps, AXIS=1, HD=HD)
        c = tl.load(cos_ptr + bs * s_cb + d).to(tl.float32)
        s = tl.load(sin_ptr + bs * s_cb + d).to(tl.float32)
        # as the twin rounds in the weights' dtype: x * cos, then + roll(x) * sin
        xc = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        y = (xc + xr * s).to(x.dtype)
        tl.store(q_ptr + bs * s_qb + g * s_qg + r * s_qr + d, y, mask=r < HPG)
        cur = tl.load(cur_ptr) + col
        tl.store(kc_ptr + b * s_kb + g * s_kg + cur * s_kt + d + 0 * r, y, mask=r == HPG)
        v = tl.load(base + (HPG + 1) * s_xr + d)
        tl.store(vc_ptr + b * s_vb + g * s_vg + cur * s_vt + d, v)

    @triton.jit
    def _attend_blocks(q, k_base, v_base, valid_base, s_kt, s_vt, s_mt, kv_len, scale, split, skip,
                       ks_base, vs_base, s_kst, s_vst, lo, hi,
                       BLOCKS: tl.constexpr, H_PAD: tl.constexpr, HD: tl.constexpr,
                       BLOCK: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr = False,
                       OWN: tl.constexpr = False):
        """Online softmax of one (row, group)'s queries q (H_PAD, HD) over split `split`'s BLOCKS
        blocks of cache columns (the last split's may run past kv_len), column `skip` left out
        (-1: none) -> (max, sum of exp, P @ V) in fp32. OWN: only columns lo..hi-1 are read (blocks
        wholly outside never loaded, the rest masked; the key_valid mask applies inside); else
        every block of the split (lo, hi unread). FP8: the caches hold E4M3 codes with a
        scale per column (ks_base, vs_base; column stride s_kst, s_vst): the codes go into the dot
        products as they are (exact in q's dtype), each column's K scale multiplies its scores and
        its V scale its softmax weights before P V (no dequantized (BLOCK, HD) tile; the twin,
        which dequantizes first, rounds in another place)."""
        d = tl.arange(0, HD)
        m = tl.full([H_PAD], -1e30, tl.float32)
        lsum = tl.zeros([H_PAD], tl.float32)
        acc = tl.zeros([H_PAD, HD], tl.float32)
        if OWN:  # the blocks that hold columns lo..hi-1
            first = split * BLOCKS
            start = tl.maximum(lo // BLOCK - first, 0).to(tl.int32)
            stop = tl.minimum(tl.cdiv(hi, BLOCK) - first, BLOCKS).to(tl.int32)
        else:
            start, stop = 0, BLOCKS
        for i in range(start, stop):
            t = (split * BLOCKS + i) * BLOCK + tl.arange(0, BLOCK)
            in_range = t < kv_len
            if OWN:
                in_range = in_range & (t >= lo) & (t < hi)
            k = tl.load(k_base + t[:, None] * s_kt + d[None, :], mask=in_range[:, None], other=0.0)
            if FP8:  # E4M3 codes are exact in q's dtype: their scales multiply the products
                k = k.to(q.dtype)
            valid = tl.load(valid_base + t * s_mt, mask=in_range, other=0) != 0
            valid = valid & (t != skip)
            if IEEE:  # fp32 inputs: full-precision products (the default would be TF32 on the GPU)
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k))  # (H_PAD, BLOCK) fp32
            if FP8:
                sc = sc * tl.load(ks_base + t * s_kst, mask=in_range, other=0.0)[None, :]
            sc = tl.where(valid[None, :], sc * scale, float("-inf"))
            new_m = tl.maximum(m, tl.max(sc, 1))  # stays finite: m starts at -1e30
            alpha = tl.exp(m - new_m)
            p = tl.exp(sc - new_m[:, None])  # 0 on masked columns
            lsum = lsum * alpha + tl.sum(p, 1)
            v = tl.load(v_base + t[:, None] * s_vt + d[None, :], mask=in_range[:, None], other=0.0)
            if FP8:  # P V = (P diag(scales)) codes
                v = v.to(q.dtype)
                p = p * tl.load(vs_base + t * s_vst, mask=in_range, other=0.0)[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = new_m
        return m, lsum, acc

    @triton.jit
    def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, G, HPG, s_ob, s_og, s_oh, s_os,
                             NSPLIT: tl.constexpr, H_PAD: tl.constexpr, HD: tl.constexpr,
                             S: tl.constexpr = 1, PDL: tl.constexpr = False):
        """The splits' partials of each (row, group)'s S x HPG query rows (token j = row // HPG,
        head row % HPG; S = 1: a decode step's heads) -> out[b, j, g, h] (strides s_ob, s_os,
        s_og, s_oh)."""
        pdl_enter(PDL)
        pid = tl.program_id(0).to(tl.int64)
        b, g = pid // G, pid % G
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, HD)
        rows = h[:, None] < S * HPG
        big_m = tl.full([H_PAD], -1e30, tl.float32)
        big_l = tl.zeros([H_PAD], tl.float32)
        o = tl.zeros([H_PAD, HD], tl.float32)
        for split in range(0, NSPLIT):
            row = pid * NSPLIT + split
            m = tl.load(m_ptr + row * H_PAD + h)
            new_m = tl.maximum(big_m, m)
            alpha = tl.exp(big_m - new_m)
            beta = tl.exp(m - new_m)
            big_l = big_l * alpha + tl.load(l_ptr + row * H_PAD + h) * beta
            part = tl.load(acc_ptr + (row * H_PAD + h[:, None]) * HD + d[None, :], mask=rows,
                           other=0.0)
            o = o * alpha[:, None] + part * beta[:, None]
            big_m = new_m
        tl.store(out_ptr + b * s_ob + (h // HPG)[:, None] * s_os + g * s_og
                 + (h % HPG)[:, None] * s_oh + d[None, :],
                 (o / big_l[:, None]).to(out_ptr.dtype.element_ty), mask=rows)


if HAVE_TRITON:

    @triton.jit
    def _silu_mul_kernel(z_ptr, out_ptr, F, s_z, s_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = col < F
        gate = tl.load(z_ptr + row * s_z + col, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(z_ptr + row * s_z + F + col, mask=ok, other=0.0).to(tl.float32)
        # as PyTorch's F.silu(gate) * up rounds: silu in fp32 rounded to the input dtype, then the
        # product rounded
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * s_o + col, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


if HAVE_TRITON:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, out_ptr, idx_ptr, pf_ptr, pf_bytes, D, eps,
                             s_x, s_y, s_h, s_o, HAS_Y: tl.constexpr, GATHER: tl.constexpr,
                             BLOCK: tl.constexpr, PREFETCH: tl.constexpr = False,
                             PDL: tl.constexpr = False):
        if PREFETCH:  # the next GEMM's weights (no dependence on the previous kernel)
            prefetch_l2(pf_ptr, pf_bytes, tl.program_id(0), tl.num_programs(0))
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BLOCK)
        ok = col < D
        if GATHER:  # x is a table: this row's input is its row idx[row] (an embedding lookup)
            h = tl.load(x_ptr + tl.load(idx_ptr + row).to(tl.int64) * s_x + col, mask=ok, other=0.0)
            tl.store(h_ptr + row * s_h + col, h, mask=ok)
        else:
            h = tl.load(x_ptr + row * s_x + col, mask=ok, other=0.0)
        if HAS_Y:  # the residual sum, rounded to the stream's dtype as x + y rounds, and kept
            h = (h.to(tl.float32) + tl.load(y_ptr + row * s_y + col, mask=ok, other=0.0)
                 .to(tl.float32)).to(h.dtype)
            tl.store(h_ptr + row * s_h + col, h, mask=ok)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / D + eps)
        w = tl.load(w_ptr + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_o + col, (hf * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


def split_scratch(programs: int, nsplit: int, h_pad: int, hd: int, out: torch.Tensor) -> tuple:
    """(max, sum of exp, P @ V) fp32 partials of `programs` (row, group) programs' `nsplit`
    splits for _attn_combine_kernel, h_pad query rows each; one split: `out` stands in for all
    three (unused: the attention kernel writes the output itself)."""
    if nsplit == 1:
        return out, out, out
    m = torch.empty((programs * nsplit, h_pad), dtype=torch.float32, device=out.device)
    return m, torch.empty_like(m), torch.empty((programs * nsplit, h_pad, hd),
                                               dtype=torch.float32, device=out.device)


def num_splits(rows_x_groups: int, columns: int, device: torch.device, *,
               target: int = 0) -> int:
    """Splits of the attended columns per (row, group): 1 when the (row, group) programs alone fill
    the device (no scratch, no combine), else up to one per BLOCK_T columns. `target`: the programs
    to aim at (0: PROGRAMS_PER_SM x the device's SMs; 528 on CPU)."""
    if not target:
        target = (PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
                  if device.type == "cuda" else 528)
    blocks = -(-columns // BLOCK_T)
    return max(1, min(blocks, -(-target // max(1, rows_x_groups))))


def head_dim_supported(hd: int) -> bool:
    """The kernels' head_dim: a power of two >= 16 (a tl.arange extent and a tl.dot dimension)."""
    return hd >= 16 and not hd & (hd - 1)


def _check_head_dim(hd: int) -> None:
    if not head_dim_supported(hd):
        raise ValueError(f"decode kernels need a power-of-two head_dim >= 16, got {hd}")


def qk_norm(qk: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
            eps: float) -> torch.Tensor:
    """[q heads; k] (..., hpg + 1, hd) with each q head RMS-normed by q_norm (hd,) and k by k_norm,
    in fp32 and rounded once to qk's dtype (the RoPE kernels' q/k norm, as PyTorch ops); q_norm
    None: qk unchanged."""
    if q_norm is None:
        return qk
    hpg, hd = qk.shape[-2] - 1, qk.shape[-1]
    q = F.rms_norm(qk[..., :hpg, :].float(), (hd,), q_norm.float(), eps)
    k = F.rms_norm(qk[..., hpg:, :].float(), (hd,), k_norm.float(), eps)
    return torch.cat([q, k], -2).to(qk.dtype)


def _norm_args(qkv: torch.Tensor, q_norm, k_norm, hd: int) -> tuple:
    """(q_norm, k_norm, QK_NORM) kernel arguments: qkv stands in for absent weights."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm are given together or not at all")
    if q_norm is None:
        return qkv, qkv, False
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w.shape != (hd,) or w.stride(-1) != 1:
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected contiguous ({hd},)")
    return q_norm, k_norm, True


def mark_columns(key_valid: torch.Tensor, cur: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """key_valid[b, cur[b]] = True (cur (1,): the one column of every row; (B,): row b's own), in
    place and returned; `rows` (B,) bool / int: only where it is set (the other rows' entries
    unchanged). Static shapes, no host sync."""
    if rows is None and cur.shape[0] == 1:
        return key_valid.index_fill_(1, cur, True)
    at = cur.expand(key_valid.shape[0])[:, None]  # (B, 1)
    if rows is None:
        return key_valid.scatter_(1, at, True)
    return key_valid.scatter_(1, at, key_valid.gather(1, at) | rows.bool()[:, None])


def write_column(cache, cur: torch.Tensor, x: torch.Tensor) -> None:
    """cache (B, G, T, hd)[b, :, cur[b]] = x (B, G, 1, hd) (cur (1,): one column for every row;
    (B,): row b's own), in place; an fp8 cache (kv_fp8.Fp8KV) gets x's codes and scales."""
    if isinstance(cache, Fp8KV):
        codes, scale = quantize_kv(x)
        write_column(cache.codes.view(torch.uint8), cur, codes.view(torch.uint8))
        write_column(cache.scale[..., None], cur, scale[..., None])
    elif cur.shape[0] == 1:
        cache.index_copy_(2, cur, x)
    else:
        cache.scatter_(2, cur[:, None, None, None].expand(x.shape), x)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, cur: torch.Tensor, *, hpg: int,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor:
    """The decode step's RoPE on the q heads and k of every (row, group) (q_norm / k_norm: after
    their norm, `qk_norm`), k and v written at cache column `cur`, as PyTorch ops (the twin of
    kernels/rope_attention.py; `cur` (1,) or, a column per row, (B,)); returns the rotated q
    (B, G, hpg, hd), contiguous."""
    B, G, R, hd = qkv.shape
    if R != hpg + 2:
        raise ValueError(f"qkv has {R} rows per group, expected hpg + 2 = {hpg + 2}")
    qk = qk_norm(qkv[:, :, :hpg + 1], q_norm, k_norm, eps)
    qk = torch.addcmul(qk * cos[:, None, None], qk.roll(hd // 2, -1), sin[:, None, None])
    write_column(k_cache, cur, qk[:, :, hpg:])
    write_column(v_cache, cur, qkv[:, :, hpg + 1:])
    return qk[:, :, :hpg].contiguous()


def rope_kv_prefill(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, *, hpg: int,
                    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                    eps: float = 0.0, pdl: bool = False, impl: str = "auto") -> torch.Tensor:
    """The prefill's rope_kv_write: qkv (B, S, G, hpg + 2, hd), cos, sin (B, S, hd) -> the rotated
    q (B, S, G, hpg, hd), contiguous; k and v of token s written to cache column s (columns
    0..S-1 of each row). One pass over the projection instead of PyTorch's RoPE element-wise
    kernels (a strided multiply, a roll copy, a multiply-add) and two cache copies. q_norm,
    k_norm (hd,): the q/k norm first (Qwen3), in the same pass."""
    B, S, G, R, hd = qkv.shape
    if R != hpg + 2:
        raise ValueError(f"qkv has {R} rows per group, expected hpg + 2 = {hpg + 2}")
    if not use_triton(qkv, impl):
        qk = qk_norm(qkv[:, :, :, :hpg + 1], q_norm, k_norm, eps)
        qk = torch.addcmul(qk * cos[:, :, None, None], qk.roll(hd // 2, -1),
                           sin[:, :, None, None])
        k_cache[:, :, :S].copy_(qk[:, :, :, hpg].transpose(1, 2))
        v_cache[:, :, :S].copy_(qkv[:, :, :, hpg + 1].transpose(1, 2))
        return qk[:, :, :, :hpg].contiguous()
    _check_head_dim(hd)
    flat = qkv.reshape(B * S, G, R, hd)  # a view for the projection's (B*S, G*R*hd) output
    cos2, sin2 = cos.reshape(B * S, hd), sin.reshape(B * S, hd)
    if flat.stride(-1) != 1 or cos2.stride(-1) != 1 or sin2.stride() != cos2.stride():
        raise ValueError("rope_kv_prefill needs qkv, cos and sin contiguous in the last dimension "
                         "and cos, sin of the same strides")
    qn, kn, norm_on = _norm_args(qkv, q_norm, k_norm, hd)
    q = torch.empty((B, S, G, hpg, hd), dtype=qkv.dtype, device=qkv.device)
    if B * S:
        zero = torch.zeros(1, dtype=torch.long, device=qkv.device)
        qf = q.view(B * S, G, hpg, hd)
        _rope_kv_kernel[(B * S * G,)](
            flat, cos2, sin2, k_cache, v_cache, zero, qf, qn, kn, eps, G, hpg, S,
            *flat.stride()[:3], cos2.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
            *qf.stride()[:3], R_PAD=triton.next_power_of_2(hpg + 1), HD=hd, QK_NORM=norm_on,
            num_warps=2, **launch_opts(flat, pdl))
    return q


def silu_mul(z: torch.Tensor, *, pdl: bool = False, impl: str = "auto") -> torch.Tensor:
    """SwiGLU of fc1's output z (N, 2F) = [gate | up] -> silu(gate) * up (N, F) in one pass."""
    N, two_f = z.shape
    if two_f % 2:
        raise ValueError(f"silu_mul: z has {two_f} columns, expected [gate | up] (an even count)")
    if not use_triton(z, impl):
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    if z.stride(-1) != 1:
        raise ValueError("silu_mul needs z contiguous in the last dimension")
    f = two_f // 2
    out = torch.empty((N, f), dtype=z.dtype, device=z.device)
    if N and f:
        block = min(1024, triton.next_power_of_2(f))
        _silu_mul_kernel[(N, triton.cdiv(f, block))](z, out, f, z.stride(0), out.stride(0),
                                                     BLOCK=block, num_warps=4,
                                                     **launch_opts(z, pdl))
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 rows: torch.Tensor | None = None, prefetch: torch.Tensor | None = None,
                 pdl: bool = False, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The decode layer's residual sum and RMSNorm in one pass: x, y (N, D) -> (h = x + y,
    rms_norm(h) * weight), both (N, D) in x's dtype; y None: h is x itself (not copied). The norm
    is computed in fp32 from h as rounded and rounded once (F.rms_norm's fp32 upcast).
    `rows` (N,) int64: x is a table (V, D) and the input is x[rows] (the decode step's embedding
    lookup in the first layer's norm: h is that gathered copy, one launch instead of two).
    `prefetch`: a tensor (the next GEMM's weight) the kernel hints into L2 (sm_90+; else unused)."""
    if rows is not None:
        if rows.dim() != 1 or (y is not None and y.shape[0] != rows.shape[0]):
            raise ValueError(f"add_rms_norm: rows {tuple(rows.shape)} must be (N,), y's rows")
        if not use_triton(x, impl):
            x = F.embedding(rows, x)
    N, D = x.shape if rows is None else (rows.shape[0], x.shape[1])
    if not use_triton(x, impl):
        h = x if y is None else x + y
        return h, F.rms_norm(h.float(), (D,), weight.float(), eps).to(x.dtype)
    if x.stride(-1) != 1 or (y is not None and y.stride(-1) != 1) or weight.stride(-1) != 1:
        raise ValueError("add_rms_norm needs x, y and weight contiguous in the last dimension")
    h = (x if y is None and rows is None else
         torch.empty((N, D), dtype=x.dtype, device=x.device))
    out = torch.empty((N, D), dtype=x.dtype, device=x.device)
    if N:
        block = triton.next_power_of_2(D)
        pf, pf_bytes, pf_on = prefetch_args(x, prefetch)
        _add_rms_norm_kernel[(N,)](x, x if y is None else y, weight, h, out,
                                   x if rows is None else rows, pf, pf_bytes, D, eps, x.stride(0),
                                   0 if y is None else y.stride(0), h.stride(0), out.stride(0),
                                   HAS_Y=y is not None, GATHER=rows is not None, BLOCK=block,
                                   PREFETCH=pf_on,
                                   num_warps=4 if block <= 2048 else 8, **launch_opts(x, pdl))
    return h, out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     key_valid: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, over the valid columns) v for the hpg queries of each (row, group),
    as PyTorch's SDPA with an additive mask (the twin of kernels/rope_attention.py): q (B, G, hpg,
    hd), caches (B, G, T, hd) (an fp8 cache dequantized to q's dtype first), key_valid (B, T) ->
    (B, G, hpg, hd) in q's dtype."""
    k_cache, v_cache = readable(k_cache, q.dtype), readable(v_cache, q.dtype)
    B, G, hpg, hd = q.shape
    T = k_cache.shape[2]
    if key_valid.shape != (B, T):
        raise ValueError(f"key_valid has shape {tuple(key_valid.shape)}, expected {(B, T)}")
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    bias = torch.zeros(key_valid.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill_(~key_valid, float("-inf"))[:, None, None, :]  # (B, 1, 1, T)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=bias, scale=scale)
