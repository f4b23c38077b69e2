"""RoPE + the K/V writes + split-KV attention for S new tokens per row in one kernel: the attention
block of speculative decoding's tail step (rollout/speculative.py), where each running row feeds
its pending token and its drafts at once.

`rope_attention_multi(qkv, cos, sin, k_cache, v_cache, col, pos, n_valid, finished, key_valid)`:
row b's new token j (j < n_valid[b]) has RoPE position pos[b] + j and goes to cache column
col[b] + j. Program (row, group, split) loads the group's S x hpg query heads and S keys and values,
rotates them, and attends every query over the row's own cached columns col[b] - pos[b] ..
col[b] - 1 where key_valid is set (its share of them: split-KV, as kernels/rope_attention.py); split
0 writes the valid new keys and values into the cache and folds them in from registers, query j
seeing new tokens 0..j (no program reads a column another program of the launch writes). With
more than one split the partial max / sum of exp / P @ V are combined by a second kernel
(layer_ops._attn_combine_kernel). `mark`:
also set key_valid at the new tokens' columns (the first layer's call). A finished row writes
nothing and reads no column; its output is meaningless (the caller discards it), as are the
outputs of tokens j >= n_valid[b].

Shapes: qkv (B, S, G, hpg + 2, hd) (the QKV projection of B x S tokens, viewed); cos, sin the RoPE
tables (T_max, hd); k_cache, v_cache (B, G, T, hd) views of the attended columns; col, pos,
n_valid (B,) int64, finished (B,) bool, key_valid (B, T) bool. Returns (B, S, G, hpg, hd), which
flattens to the (B * S, heads * hd) input of the output projection. bf16 / fp16 / fp32 caches (no
fp8 cache, no q/k norm: the tail step runs PyTorch ops then). The twin (`impl="torch"`) is the
reference the kernel is tested against (tests/unit/test_spec_attention.py, under the interpreter).
"""

from __future__ import annotations

import math

import torch

from . import layer_ops
from ._dispatch import HAVE_TRITON, launch_opts, use_triton

# the kernel holds S x hpg query rows (padded to 16, 32 or 64) where the decode kernel holds
# hpg: 8 warps keep its tiles in registers (docs/perf_log.md)
MULTI_WARPS = 8

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ._dispatch import pdl_enter
    from .layer_ops import _attend_blocks

    @triton.jit
    def _rope_rows(x_ptr, rows_ok, at, cos_ptr, sin_ptr, s_cb, d, rolled):
        """Rows of x (addresses x_ptr (R, 1) + d) rotated at table rows `at` (R,), rounded as
        rope_kv_write rounds: x * cos in x's dtype, then + roll(x) * sin."""
        x = tl.load(x_ptr + d[None, :], mask=rows_ok[:, None], other=0.0)
        xr = tl.load(x_ptr + rolled[None, :], mask=rows_ok[:, None], other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + at[:, None] * s_cb + d[None, :]).to(tl.float32)
        s = tl.load(sin_ptr + at[:, None] * s_cb + d[None, :]).to(tl.float32)
        return ((x.to(tl.float32) * c).to(x.dtype).to(tl.float32) + xr * s).to(x.dtype)

    @triton.jit
    def _multi_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, col_ptr, nv_ptr, fin_ptr, kc_ptr, vc_ptr,
                      valid_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, G, HPG, S, kv_len, scale,
                      s_xb, s_xs, s_xg, s_xr, s_cb, s_kb, s_kg, s_kt, s_vb, s_vg, s_vt, s_mb, s_mt,
                      s_ob, s_os, s_og, s_oh,
                      NSPLIT: tl.constexpr, BLOCKS: tl.constexpr, H_PAD: tl.constexpr,
                      S_PAD: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
                      IEEE: tl.constexpr, MARK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        pid = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b, g = pid // G, pid % G
        hq = tl.arange(0, H_PAD)  # query row: new token hq // HPG, head hq % HPG
        j, hh = hq // HPG, hq % HPG
        q_ok = hq < S * HPG
        jj = tl.arange(0, S_PAD)  # new key / value row
        k_ok = jj < S
        d = tl.arange(0, HD)
        rolled = (d + HD // 2) % HD
        pos = tl.load(pos_ptr + b)
        col = tl.load(col_ptr + b)
        nv = tl.load(nv_ptr + b)
        fin = tl.load(fin_ptr + b) != 0
        base = qkv_ptr + b * s_xb + g * s_xg
        # tokens past n_valid are padding: rotated at the row's first position (in the tables)
        q = _rope_rows(base + j[:, None] * s_xs + hh[:, None] * s_xr, q_ok,
                       tl.where(j < nv, pos + j, pos), cos_ptr, sin_ptr, s_cb, d, rolled)
        k_new = _rope_rows(base + jj[:, None] * s_xs + HPG * s_xr, k_ok,
                           tl.where(jj < nv, pos + jj, pos), cos_ptr, sin_ptr, s_cb, d, rolled)
        v_new = tl.load(base + jj[:, None] * s_xs + (HPG + 1) * s_xr + d[None, :],
                        mask=k_ok[:, None], other=0.0)
        written = (jj < nv) & ~fin
        if split == 0:
            cols = col + jj
            tl.store(kc_ptr + b * s_kb + g * s_kg + cols[:, None] * s_kt + d[None, :], k_new,
                     mask=written[:, None])
            tl.store(vc_ptr + b * s_vb + g * s_vg + cols[:, None] * s_vt + d[None, :], v_new,
                     mask=written[:, None])
            if MARK:
                if g == 0:
                    tl.store(valid_ptr + b * s_mb + cols * s_mt, 1, mask=written)
        lo = tl.where(fin, col, col - pos)  # the row's cached tokens (none once finished)
        m, lsum, acc = _attend_blocks(q, kc_ptr + b * s_kb + g * s_kg, vc_ptr + b * s_vb + g * s_vg,
                                      valid_ptr + b * s_mb, s_kt, s_vt, s_mt, kv_len, scale, split,
                                      -1, kc_ptr, vc_ptr, 0, 0, lo, col,
                                      BLOCKS=BLOCKS, H_PAD=H_PAD, HD=HD, BLOCK=BLOCK, IEEE=IEEE,
                                      FP8=False, OWN=True)
        if split == 0:  # the new tokens, from registers: query j sees new tokens 0..j
            if IEEE:
                sc = tl.dot(q, tl.trans(k_new), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k_new))  # (H_PAD, S_PAD) fp32
            # every query row keeps new token 0 (a finished or padding row's output is unused;
            # this keeps its sums finite)
            see = ((jj[None, :] <= j[:, None]) & written[None, :]) | (jj[None, :] == 0)
            sc = tl.where(see, sc * scale, float("-inf"))
            new_m = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp(m - new_m)
            p = tl.exp(sc - new_m[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v_new.dtype), v_new, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v_new.dtype), v_new)
            acc = acc * alpha[:, None] + pv
            m = new_m
        if NSPLIT == 1:
            tl.store(out_ptr + b * s_ob + j[:, None] * s_os + g * s_og + hh[:, None] * s_oh
                     + d[None, :], (acc / lsum[:, None]).to(out_ptr.dtype.element_ty),
                     mask=q_ok[:, None])
        else:
            row = pid * NSPLIT + split
            tl.store(m_ptr + row * H_PAD + hq, m)
            tl.store(l_ptr + row * H_PAD + hq, lsum)
            tl.store(acc_ptr + (row * H_PAD + hq[:, None]) * HD + d[None, :], acc)


def rope_attention_multi(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, col: torch.Tensor,
                         pos: torch.Tensor, n_valid: torch.Tensor, finished: torch.Tensor,
                         key_valid: torch.Tensor, *, mark: bool = False,
                         scale: float | None = None, splits: int | None = None,
                         pdl: bool = False, impl: str = "auto") -> torch.Tensor:
    """The module docstring's attention block -> (B, S, G, hpg, hd) in qkv's dtype."""
    B, S, G, R, hd = qkv.shape
    hpg = R - 2
    T = k_cache.shape[2]
    if key_valid.shape != (B, T):
        raise ValueError(f"key_valid has shape {tuple(key_valid.shape)}, expected {(B, T)}")
    for name, t in (("col", col), ("pos", pos), ("n_valid", n_valid), ("finished", finished)):
        if t.shape != (B,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({B},)")
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    if not use_triton(qkv, impl):
        return _twin(qkv, cos, sin, k_cache, v_cache, col, pos, n_valid, finished, key_valid,
                     mark=mark, scale=scale)
    layer_ops._check_head_dim(hd)
    if (qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride()
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        raise ValueError("rope_attention_multi needs qkv, cos, sin and the caches contiguous in "
                         "the last dimension and cos, sin of the same strides")
    nsplit = splits or layer_ops.num_splits(B * G, T, qkv.device)
    blocks = -(-T // (nsplit * layer_ops.BLOCK_T))
    h_pad = max(16, triton.next_power_of_2(S * hpg))
    s_pad = max(16, triton.next_power_of_2(S))
    out = torch.empty((B, S, G, hpg, hd), dtype=qkv.dtype, device=qkv.device)
    m, lsum, acc = layer_ops.split_scratch(B * G, nsplit, h_pad, hd, out)
    if B:
        valid = key_valid.view(torch.uint8) if key_valid.dtype == torch.bool else key_valid
        fin = finished.view(torch.uint8) if finished.dtype == torch.bool else finished
        _multi_kernel[(B * G, nsplit)](
            qkv, cos, sin, pos, col, n_valid, fin, k_cache, v_cache, valid, m, lsum, acc, out,
            G, hpg, S, T, scale, *qkv.stride()[:4], cos.stride(0), *k_cache.stride()[:3],
            *v_cache.stride()[:3], valid.stride(0), valid.stride(1), *out.stride()[:4],
            NSPLIT=nsplit, BLOCKS=blocks, H_PAD=h_pad, S_PAD=s_pad, HD=hd,
            BLOCK=layer_ops.BLOCK_T, IEEE=qkv.dtype == torch.float32, MARK=mark,
            num_warps=MULTI_WARPS, num_stages=layer_ops.ATTN_STAGES, **launch_opts(qkv, pdl))
        if nsplit > 1:
            s_ob, s_os, s_og, s_oh = out.stride()[:4]
            layer_ops._attn_combine_kernel[(B * G,)](m, lsum, acc, out, G, hpg, s_ob, s_og, s_oh,
                                                  s_os, NSPLIT=nsplit, H_PAD=h_pad, HD=hd, S=S,
                                                  num_warps=4, **launch_opts(m, pdl))
    return out


def _twin(qkv, cos, sin, k_cache, v_cache, col, pos, n_valid, finished, key_valid, *, mark: bool,
          scale: float) -> torch.Tensor:
    """The kernel's math as PyTorch ops (rounded as rope_kv_write rounds; sums in another order)."""
    B, S, G, R, hd = qkv.shape
    hpg, T = R - 2, k_cache.shape[2]
    dev = qkv.device
    j = torch.arange(S, device=dev)
    new_ok = (j < n_valid[:, None]) & ~finished[:, None]  # (B, S) tokens written and attended
    at = torch.where(j < n_valid[:, None], pos[:, None] + j, pos[:, None])  # (B, S)
    c, s = cos[at][:, :, None, None], sin[at][:, :, None, None]  # (B, S, 1, 1, hd)
    qk = qkv[:, :, :, :hpg + 1]
    qk = ((qk * c).to(qkv.dtype).float() + qk.roll(hd // 2, -1).float() * s).to(qkv.dtype)
    q, k_new, v_new = qk[:, :, :, :hpg], qk[:, :, :, hpg], qkv[:, :, :, hpg + 1]  # (B, S, G, ..)
    b_ix, cols = torch.arange(B, device=dev)[:, None].expand(B, S), col[:, None] + j
    ok_b, ok_c = b_ix[new_ok], cols[new_ok]
    k_cache[ok_b, :, ok_c] = k_new[new_ok]
    v_cache[ok_b, :, ok_c] = v_new[new_ok]
    t = torch.arange(T, device=dev)
    cached = (key_valid & (t >= torch.where(finished, col, col - pos)[:, None])
              & (t < col[:, None]))  # (B, T)
    if mark:
        key_valid[ok_b, ok_c] = True
    # keys: the T cached columns, then the S new tokens (query j sees new 0..j, and always 0)
    keys = torch.cat([k_cache.float(), k_new.float().permute(0, 2, 1, 3)], 2)  # (B, G, T + S, hd)
    vals = torch.cat([v_cache.float(), v_new.float().permute(0, 2, 1, 3)], 2)
    see_new = ((j[None, :] <= j[:, None]) & new_ok[:, None, :]) | (j[None, :] == 0)  # (B, Sq, Sk)
    see = torch.cat([cached[:, None, :].expand(B, S, T), see_new], 2)  # (B, S, T + S)
    sc = torch.einsum("bsghd,bgtd->bsght", q.float(), keys) * scale
    sc = sc.masked_fill(~see[:, :, None, None, :], float("-inf"))
    p = torch.softmax(sc, -1)
    return torch.einsum("bsght,bgtd->bsghd", p.to(qkv.dtype).float(), vals).to(qkv.dtype)
