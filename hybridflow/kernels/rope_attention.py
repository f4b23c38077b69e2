"""RoPE + the K/V write + split-KV decode attention in one kernel (a decode step's attention block).

`rope_attention(qkv, cos, sin, k_cache, v_cache, cur, key_valid, hpg)` computes what
`layer_ops.rope_kv_write` followed by `layer_ops.decode_attention` (the PyTorch twins) compute, in
one launch per layer: program (row, group, split) reads the group's projected rows [q heads (hpg);
k; v], rotates q and k (RoPE, rounded as the twin rounds), and attends over the cached columns of
its split with the current token's column left out; split 0 writes k and v into cache column
`cur` and folds the current token in from registers (no program reads that column back, so no
program waits on another's store). With one split per (row, group) the program writes the
output, else the splits' max, sum of exp and P @ V go through `layer_ops._attn_combine_kernel`.
The sums run in another order than the twins' (the current column last), so results agree to
rounding. `cur` is one column for every row (1,) (the single-turn step) or one per row (B,) (the
multi-turn step, whose rows sit at different columns; a constexpr picks the load, so the (1,) path
is unchanged); `mark_valid` may name the rows to mark (the multi-turn step's ready rows: the
others write a scratch column that must stay invalid). The decode step hands it the RoPE tables and the rows' positions (no gathered cos / sin
copies) and lets it mark column `cur` valid in the first layer (`mark_valid`: no fill launch).
With `q_norm`, `k_norm` (Qwen3's per-head RMSNorm, applied before RoPE) the program norms the q
heads and k it has just loaded (layer_ops._norm_rows; twin: layer_ops.qk_norm inside
rope_kv_write): no extra pass over the projection. With `finished` (the generator's decode step)
a program reads only its row's own columns, from the row's first prompt token to the current one,
and nothing for a finished row: left padding, window columns not written yet and rows that wait
for compaction cost no cache reads.

Shapes: qkv (B, G, hpg + 2, hd) (the QKV projection's view); cos, sin (B, hd), or the tables
(T_max, hd) with `positions`; k_cache, v_cache (B, G, T, hd) strided views of the attended columns
0..T-1 (cur < T); key_valid (B, T) bool (column `cur` is not read); returns (B, G, hpg, hd) in
qkv's dtype. The caches may be fp8 (kernels/kv_fp8.Fp8KV, rollout.kv_cache_dtype=fp8): the program
then quantizes k and v as kv_fp8.quantize_kv does (the same bits), writes codes and scales, folds
the current token in at its dequantized value (what later steps read back) and dequantizes each
block of columns it attends over to qkv's dtype (the twins: write_column / decode_attention on the
Fp8KV).
"""

from __future__ import annotations

import math

import torch

from . import layer_ops
from ._dispatch import HAVE_TRITON, launch_opts, prefetch_args, use_triton
from .kv_fp8 import Fp8KV

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ._dispatch import pdl_enter, prefetch_l2

    from .layer_ops import _attend_blocks  # the split's online softmax, column cur left out
    from .layer_ops import _norm_rows  # the q/k norm

    @triton.jit
    def _quantize_row(x):
        """x (HD,) -> (E4M3 codes, fp32 scale), the bits of kv_fp8.quantize_kv: the scale a product with fp32(1 / 448), codes an IEEE division,
        then each value rounded to the E4M3 grid in fp32 (to nearest even: adding 2^(e + 20), e
        its binade's exponent, at least the subnormals' -6, leaves a multiple of 2^(e - 3)) and
        the sign put back, so the cast is exact (Triton's interpreter rounds a carry into the next
        binade wrongly; the GPU's cvt would round alike)."""
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), 0)
        sc = tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)
        y = tl.math.div_rn(xf, sc + tl.zeros_like(xf))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        a = tl.abs(y)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        c = ((e + 147) << 23).to(tl.float32, bitcast=True)  # 2^(e + 20)
        r = (a + c) - c
        sign = y.to(tl.int32, bitcast=True) & -2147483648
        r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return r.to(tl.float8e4nv), sc

    @triton.jit
    def _rope_attn_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, cur_ptr, valid_ptr,
                          mark_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, pf_ptr, pf_bytes, qn_ptr,
                          kn_ptr, eps, ks_ptr, vs_ptr, fin_ptr,
                          G, HPG, kv_len, scale,
                          s_xb, s_xg, s_xr, s_cb, s_kb, s_kg, s_kt, s_vb, s_vg, s_vt, s_mb, s_mt,
                          s_ob, s_og, s_oh, s_ksb, s_ksg, s_kst, s_vsb, s_vsg, s_vst,
                          NSPLIT: tl.constexpr, BLOCKS: tl.constexpr,
                          H_PAD: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
                          IEEE: tl.constexpr, TABLES: tl.constexpr, MARK: tl.constexpr,
                          PER_ROW: tl.constexpr = False, MARK_ROWS: tl.constexpr = False,
                          QK_NORM: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                          FP8: tl.constexpr = False, OWN: tl.constexpr = False,
                          PDL: tl.constexpr = False):
        pdl_enter(PDL)
        pid = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b, g = pid // G, pid % G
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, HD)
        rows = h[:, None] < HPG
        rolled = (d + HD // 2) % HD
        base = qkv_ptr + b * s_xb + g * s_xg
        at = tl.load(pos_ptr + b) if TABLES else b  # the row's position in the RoPE tables
        c = tl.load(cos_ptr + at * s_cb + d).to(tl.float32)
        s = tl.load(sin_ptr + at * s_cb + d).to(tl.float32)
        # RoPE as rope_kv_write rounds: x * cos in the weights' dtype, then + roll(x) * sin
        qx = tl.load(base + h[:, None] * s_xr + d[None, :], mask=rows, other=0.0)
        qr = tl.load(base + h[:, None] * s_xr + rolled[None, :], mask=rows, other=0.0)
        qr = qr.to(tl.float32)
        kx = tl.load(base + HPG * s_xr + d)
        kr = tl.load(base + HPG * s_xr + rolled).to(tl.float32)
        if QK_NORM:  # each q head and k RMS-normed over HD before RoPE
            wq = tl.load(qn_ptr + d).to(tl.float32)
            wqr = tl.load(qn_ptr + rolled).to(tl.float32)
            qx, qr = _norm_rows(qx, qr, wq[None, :], wqr[None, :], eps, AXIS=1, HD=HD)
            wk = tl.load(kn_ptr + d).to(tl.float32)
            wkr = tl.load(kn_ptr + rolled).to(tl.float32)
            kx, kr = _norm_rows(kx, kr, wk, wkr, eps, AXIS=0, HD=HD)
        q = ((qx.to(tl.float32) * c[None, :]).to(qx.dtype).to(tl.float32)
             + qr * s[None, :]).to(qx.dtype)
        k_new = ((kx.to(tl.float32) * c).to(kx.dtype).to(tl.float32) + kr * s).to(kx.dtype)
        v_new = tl.load(base + (HPG + 1) * s_xr + d)
        if PER_ROW:  # this row's own column
            cur = tl.load(cur_ptr + b)
        else:  # one column for every row
            cur = tl.load(cur_ptr)
        if FP8:  # as kv_fp8.quantize_kv: the codes written, their dequantized values used
            k_codes, k_sc = _quantize_row(k_new)
            v_codes, v_sc = _quantize_row(v_new)
            k_new = (k_codes.to(tl.float32) * k_sc).to(kx.dtype)
            v_new = (v_codes.to(tl.float32) * v_sc).to(kx.dtype)
        if split == 0:
            if FP8:
                tl.store(kc_ptr + b * s_kb + g * s_kg + cur * s_kt + d, k_codes)
                tl.store(vc_ptr + b * s_vb + g * s_vg + cur * s_vt + d, v_codes)
                tl.store(ks_ptr + b * s_ksb + g * s_ksg + cur * s_kst, k_sc)
                tl.store(vs_ptr + b * s_vsb + g * s_vsg + cur * s_vst, v_sc)
            else:
                tl.store(kc_ptr + b * s_kb + g * s_kg + cur * s_kt + d, k_new)
                tl.store(vc_ptr + b * s_vb + g * s_vg + cur * s_vt + d, v_new)
            if MARK:  # column cur valid for later steps (no program of this launch reads it)
                if g == 0:
                    if MARK_ROWS:  # only the rows whose mark is set; the others keep theirs
                        tl.store(valid_ptr + b * s_mb + cur * s_mt, 1,
                                 mask=tl.load(mark_ptr + b) != 0)
                    else:
                        tl.store(valid_ptr + b * s_mb + cur * s_mt, 1)
        lo, hi = 0, kv_len
        if OWN:  # the row's tokens: columns cur - position .. cur - 1 (none once it finished)
            hi = cur
            lo = tl.where(tl.load(fin_ptr + b) != 0, cur, cur - at)
        m, lsum, acc = _attend_blocks(q, kc_ptr + b * s_kb + g * s_kg, vc_ptr + b * s_vb + g * s_vg,
                                      valid_ptr + b * s_mb, s_kt, s_vt, s_mt, kv_len, scale, split,
                                      cur, ks_ptr + b * s_ksb + g * s_ksg,
                                      vs_ptr + b * s_vsb + g * s_vsg, s_kst, s_vst, lo, hi,
                                      BLOCKS=BLOCKS, H_PAD=H_PAD, HD=HD, BLOCK=BLOCK, IEEE=IEEE,
                                      FP8=FP8, OWN=OWN)
        if split == 0:  # the current token, from registers (P rounded to v's dtype as in tl.dot)
            sc = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
            new_m = tl.maximum(m, sc)
            alpha = tl.exp(m - new_m)
            p = tl.exp(sc - new_m)
            lsum = lsum * alpha + p
            acc = (acc * alpha[:, None]
                   + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :])
            m = new_m
        if NSPLIT == 1:
            tl.store(out_ptr + b * s_ob + g * s_og + h[:, None] * s_oh + d[None, :],
                     (acc / lsum[:, None]).to(out_ptr.dtype.element_ty), mask=rows)
        else:
            row = pid * NSPLIT + split
            tl.store(m_ptr + row * H_PAD + h, m)
            tl.store(l_ptr + row * H_PAD + h, lsum)
            tl.store(acc_ptr + (row * H_PAD + h[:, None]) * HD + d[None, :], acc, mask=rows)
        if PREFETCH:  # the output projection's weights, after this program's K/V stream
            prefetch_l2(pf_ptr, pf_bytes, pid * NSPLIT + split, tl.num_programs(0) * NSPLIT)


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, cur: torch.Tensor, key_valid: torch.Tensor, *, hpg: int,
                   positions: torch.Tensor | None = None, scale: float | None = None,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 0.0, mark_valid: bool | torch.Tensor = False,
                   prefetch: torch.Tensor | None = None,
                   finished: torch.Tensor | None = None,
                   splits: int | None = None, pdl: bool = False,
                   impl: str = "auto") -> torch.Tensor:
    """layer_ops.rope_kv_write then layer_ops.decode_attention over the given cache columns, in one
    kernel (the module docstring); "torch": those two twins. With `positions` (B,) int64, cos and
    sin are the RoPE tables (T_max, hd) and each row reads its position's entries (no gathered
    copy). `q_norm`, `k_norm` (hd,): Qwen3's q/k norm (epsilon `eps`) before RoPE.
    `cur` (1,) int64: every row's K/V goes to that column; (B,): row b's to column cur[b] (the
    multi-turn step, whose rows sit at different columns).
    `mark_valid`: also set key_valid[b, cur[b]] (the decode step's own column, which this kernel
    never reads: it folds the token in from registers), so the step needs no fill of its own; a
    (B,) bool / int tensor: only in the rows where it is set (the others' entries unchanged).
    `prefetch`: a tensor (the output projection's weight) each program hints into L2 when done
    (sm_90+; kernels/_dispatch.prefetch_l2). `finished` (B,) bool, with `positions`: each row's
    tokens are the columns cur[b] - positions[b] .. cur[b] - 1 (positions count real tokens: the
    generator's left-padded rows at one column cur (1,), or the multi-turn step's rows each at its
    own column (B,)), so the kernel reads only those blocks, and none for a row where finished is
    set (its output is then its own token's V: the caller discards it); the twin attends as
    without it (the same output for the unfinished rows).
    `splits`: the split count of the columns (None:
    layer_ops.num_splits for the device; tests force counts)."""
    B, G, R, hd = qkv.shape
    if positions is not None and not use_triton(qkv, impl):
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
    T = k_cache.shape[2]
    fp8 = isinstance(k_cache, Fp8KV)
    if fp8 != isinstance(v_cache, Fp8KV):
        raise ValueError("rope_attention: k_cache and v_cache must both be fp8 (Fp8KV) or neither")
    if R != hpg + 2:
        raise ValueError(f"qkv has {R} rows per group, expected hpg + 2 = {hpg + 2}")
    if key_valid.shape != (B, T):
        raise ValueError(f"key_valid has shape {tuple(key_valid.shape)}, expected {(B, T)}")
    if cur.shape not in ((1,), (B,)):
        raise ValueError(f"cur has shape {tuple(cur.shape)}, expected (1,) or ({B},)")
    own = finished is not None
    if own and (positions is None or finished.shape != (B,)):
        raise ValueError(f"rope_attention: `finished` needs `positions` and a ({B},) tensor, got "
                         f"positions {None if positions is None else tuple(positions.shape)}, "
                         f"finished {tuple(finished.shape)}")
    rows_marked = torch.is_tensor(mark_valid)
    if rows_marked and mark_valid.shape != (B,):
        raise ValueError(f"mark_valid has shape {tuple(mark_valid.shape)}, expected ({B},)")
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    if not use_triton(qkv, impl):
        # the kernel attends to the current token whatever key_valid says of its column
        seen = layer_ops.mark_columns(key_valid.clone(), cur)
        if rows_marked or mark_valid:
            layer_ops.mark_columns(key_valid, cur, mark_valid if rows_marked else None)
        q = layer_ops.rope_kv_write(qkv, cos, sin, k_cache, v_cache, cur, hpg=hpg, q_norm=q_norm,
                                    k_norm=k_norm, eps=eps)
        return layer_ops.decode_attention(q, k_cache, v_cache, seen, scale=scale)
    layer_ops._check_head_dim(hd)
    kc, vc = (k_cache.codes, v_cache.codes) if fp8 else (k_cache, v_cache)
    ks, vs = (k_cache.scale, v_cache.scale) if fp8 else (qkv, qkv)  # (unread stand-ins)
    if (qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride()
            or kc.stride(-1) != 1 or vc.stride(-1) != 1):
        raise ValueError("rope_attention needs qkv, cos, sin and the caches contiguous in the last "
                         "dimension and cos, sin of the same strides")
    qn, kn, norm_on = layer_ops._norm_args(qkv, q_norm, k_norm, hd)
    nsplit = splits or layer_ops.num_splits(B * G, T, qkv.device)
    blocks = -(-T // (nsplit * layer_ops.BLOCK_T))
    h_pad = max(16, triton.next_power_of_2(hpg))
    out = torch.empty((B, G, hpg, hd), dtype=qkv.dtype, device=qkv.device)
    m, lsum, acc = layer_ops.split_scratch(B * G, nsplit, h_pad, hd, out)
    if B:
        valid = key_valid.view(torch.uint8) if key_valid.dtype == torch.bool else key_valid
        pf, pf_bytes, pf_on = prefetch_args(qkv, prefetch)
        mark = cur  # stands in when every row is marked or none
        if rows_marked:
            mark = mark_valid.view(torch.uint8) if mark_valid.dtype == torch.bool else mark_valid
        _rope_attn_kernel[(B * G, nsplit)](
            qkv, cos, sin, cur if positions is None else positions, kc, vc, cur, valid,
            mark, m, lsum, acc, out, pf, pf_bytes, qn, kn, eps, ks, vs,
            (finished.view(torch.uint8) if finished.dtype == torch.bool else finished) if own
            else cur, G,
            hpg, T, scale,
            *qkv.stride()[:3], cos.stride(0), *kc.stride()[:3], *vc.stride()[:3],
            valid.stride(0), valid.stride(1), *out.stride()[:3],
            *(ks.stride()[:3] if fp8 else (0, 0, 0)), *(vs.stride()[:3] if fp8 else (0, 0, 0)),
            NSPLIT=nsplit, BLOCKS=blocks,
            H_PAD=h_pad, HD=hd, BLOCK=layer_ops.BLOCK_T, IEEE=qkv.dtype == torch.float32,
            TABLES=positions is not None, MARK=rows_marked or bool(mark_valid),
            PER_ROW=cur.shape[0] > 1, MARK_ROWS=rows_marked, QK_NORM=norm_on, PREFETCH=pf_on,
            FP8=fp8, OWN=own,
            num_warps=layer_ops.ATTN_WARPS, num_stages=layer_ops.ATTN_STAGES,
            **launch_opts(qkv, pdl))
        if nsplit > 1:
            layer_ops._attn_combine_kernel[(B * G,)](m, lsum, acc, out, G, hpg,
                                                  *out.stride()[:3], 0, NSPLIT=nsplit,
                                                  H_PAD=h_pad, HD=hd, num_warps=4,
                                                  **launch_opts(m, pdl))
    return out
