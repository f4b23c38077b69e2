"""Run by tests/unit/test_decode_kernels.py in a fresh interpreter with TRITON_INTERPRET=1 (Triton's
CPU interpreter reads the variable when the kernels are defined, so it must be set before the first
import of hybridflow.kernels.layer_ops in the process). Prints one JSON object of results."""

import json
import os
import sys
from unittest import mock

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybridflow.config import DecodeKernelOptions, ModelConfig  # noqa: E402
from hybridflow.kernels import layer_ops as kern  # noqa: E402
from hybridflow.kernels import rope_attention as fused  # noqa: E402
from hybridflow.kernels import next_token as ksampling  # noqa: E402
from hybridflow.rollout.options import PREFETCHABLE  # noqa: E402
from tests.unit.test_rollout import PROMPTS, make, opts, polled, random_params, rc  # noqa: E402
from tests.unit.triton_interp import patch  # noqa: E402

patch()


def tables(hd, length=256):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    f = torch.outer(torch.arange(length).float(), inv)
    return torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)


def rope_attention_cases():
    """rope_attention (RoPE + K/V write + attention in one kernel) against rope_kv_write then
    decode_attention, both twins: the output with 1, 2 and one-per-block splits (the current
    column folded in by split 0), the cache written at column cur only, and a row whose only
    valid key is its own token (its value, exactly)."""
    out = []
    g = torch.Generator().manual_seed(4)
    for B, G, hpg, hd, T, kv in [(3, 2, 7, 64, 200, 150), (2, 4, 6, 128, 64, 64),
                                 (5, 1, 1, 16, 70, 70), (2, 2, 14, 32, 130, 65)]:
        cache = torch.randn(2, 3, B + 1, G, T, hd, generator=g)  # (k/v, layer, rows, G, T, hd)
        before = cache.clone()
        qkv = torch.randn(B, G, hpg + 2, hd, generator=g)
        cos_t, sin_t = tables(hd)
        pos = torch.randint(0, 256, (B,), generator=g)
        cos, sin = cos_t[pos], sin_t[pos]
        cur = torch.tensor([kv // 2])  # a column inside the window (a later split's, too)
        valid = torch.rand(B, T, generator=g) < 0.5
        valid[:, kv // 2] = True
        valid[0, :kv] = False
        valid[0, kv // 2] = True  # row 0: only its own token
        ref_cache = cache.clone()
        rk, rv = ref_cache[0, 1, :B, :, :kv], ref_cache[1, 1, :B, :, :kv]
        ref = fused.rope_attention(qkv, cos, sin, rk, rv, cur, valid[:, :kv], hpg=hpg, impl="torch")
        err, splits = 0.0, []
        for target in (1, 2 * B * G, 10_000):
            splits.append(kern.num_splits(B * G, kv, qkv.device, target=target))
            cache.copy_(before)
            kc, vc = cache[0, 1, :B, :, :kv], cache[1, 1, :B, :, :kv]
            a = fused.rope_attention(qkv, cos, sin, kc, vc, cur, valid[:, :kv], hpg=hpg,
                                     splits=splits[-1], impl="triton")
            err = max(err, (a - ref).abs().max().item())
        tabled = cache.clone()  # the tables and positions in place of the gathered cos / sin
        cache.copy_(before)  # (the last split count still set: the same sums as `a`)
        kc, vc = cache[0, 1, :B, :, :kv], cache[1, 1, :B, :, :kv]
        at = fused.rope_attention(qkv, cos_t, sin_t, kc, vc, cur, valid[:, :kv], hpg=hpg,
                                  positions=pos, splits=splits[-1], impl="triton")
        # mark_valid: column cur becomes true (the kernel never reads it: cleared here first),
        # the output unchanged (the same split count as `at`), no other column touched
        marked = valid.clone()
        marked[:, kv // 2] = False
        kc, vc = cache[0, 1, :B, :, :kv].clone(), cache[1, 1, :B, :, :kv].clone()
        am = fused.rope_attention(qkv, cos_t, sin_t, kc, vc, cur, marked[:, :kv], hpg=hpg,
                                  positions=pos, mark_valid=True, splits=splits[-1],
                                  impl="triton")
        twin_marked = valid.clone()
        twin_marked[:, kv // 2] = False
        fused.rope_attention(qkv, cos_t, sin_t, rk.clone(), rv.clone(), cur, twin_marked[:, :kv],
                             hpg=hpg, positions=pos, mark_valid=True, impl="torch")
        at_twin = fused.rope_attention(qkv, cos_t, sin_t, rk.clone(), rv.clone(), cur,
                                       valid[:, :kv], hpg=hpg, positions=pos, impl="torch")
        out.append({"shape": [B, G, hpg, hd, T, kv], "attn_err": err, "splits": splits,
                    "tables_equal": bool(torch.equal(at, a) and torch.equal(cache, tabled)),
                    "tables_twin_equal": bool(torch.equal(at_twin, ref)),
                    "mark_equal": bool(torch.equal(am, at)), "marked": bool(
                        torch.equal(marked, valid) and torch.equal(twin_marked, valid)),
                    "cache_err": (cache - ref_cache).abs().max().item(),
                    "only_column_written": bool(torch.equal(
                        (cache != before).nonzero()[:, [1, 4]].unique(dim=0),
                        torch.tensor([[1, kv // 2]]))),
                    "row0_is_its_value": (a[0] - qkv[0, :, hpg + 1][:, None]).abs().max().item()})
    return out


def own_columns_cases():
    """rope_attention's `finished` (the generator's step): rows left-padded to different lengths
    (row b's tokens in columns cur - pos[b] .. cur - 1), one row finished. The unfinished rows'
    output equals the twin's on a clean cache and is bit-equal to the kernel without `finished`,
    while every column outside a row's own (the padding, the window past cur, and all of the
    finished row's) holds NaN: a column the kernel read would poison its row. The finished row's
    output is its own token's V."""
    out = []
    g = torch.Generator().manual_seed(11)
    for B, G, hpg, hd, T, cur_col in [(4, 2, 7, 64, 256, 150), (3, 1, 2, 16, 130, 129),
                                      (5, 2, 3, 32, 200, 64)]:
        cos_t, sin_t = tables(hd)
        qkv = torch.randn(B, G, hpg + 2, hd, generator=g)
        cur = torch.tensor([cur_col])
        pos = torch.randint(1, cur_col + 1, (B,), generator=g)
        pos[0] = cur_col  # a row without padding
        col = torch.arange(T)
        valid = (col[None, :] >= cur_col - pos[:, None]) & (col[None, :] < cur_col)
        finished = torch.zeros(B, dtype=torch.bool)
        finished[-1] = True
        clean = torch.randn(2, B, G, T, hd, generator=g)
        poisoned = clean.clone()
        poisoned[:, ~valid[:, None, :, None].expand(B, G, T, hd)] = float("nan")
        poisoned[:, -1] = float("nan")  # the finished row: none of its columns may be read
        poisoned[:, :, :, cur_col] = clean[:, :, :, cur_col]  # (written by the kernel)
        ref = fused.rope_attention(qkv, cos_t, sin_t, clean[0].clone(), clean[1].clone(), cur,
                                   valid, hpg=hpg, positions=pos, impl="torch")
        errs, equal = [], True
        for target in (1, 2 * B * G, 10_000):
            splits = kern.num_splits(B * G, T, qkv.device, target=target)
            c = poisoned.clone()
            a = fused.rope_attention(qkv, cos_t, sin_t, c[0], c[1], cur, valid, hpg=hpg,
                                     positions=pos, finished=finished, splits=splits,
                                     impl="triton")
            c = clean.clone()
            plain = fused.rope_attention(qkv, cos_t, sin_t, c[0], c[1], cur, valid, hpg=hpg,
                                         positions=pos, splits=splits, impl="triton")
            errs.append((a[:-1] - ref[:-1]).abs().max().item())
            equal = equal and bool(torch.equal(a[:-1], plain[:-1]))
        out.append({"shape": [B, G, hpg, hd, T, cur_col], "errs": errs, "bit_equal": equal,
                    "finished_is_its_value": (a[-1] - qkv[-1, :, hpg + 1][:, None]).abs().max()
                    .item()})
    return out


def argmax_cases():
    """argmax_rows (two passes over vocabulary chunks) against torch.argmax: a vocabulary that is
    not a multiple of the chunk, ties inside a chunk, across chunks and across a chunk's lanes (the
    first id wins), a row of one repeated value, a row whose maximum is the last id; fp32 and fp16."""
    g = torch.Generator().manual_seed(5)
    out = []
    for dtype in (torch.float32, torch.float16):
        B, V = 6, 1000
        x = torch.randn(B, V, generator=g).to(dtype)
        x[1, [3, 700]] = 9.0  # a tie across chunks (chunk 256)
        x[2, [10, 10 + 64]] = 9.0  # a tie across lanes of one block (block 64)
        x[3] = 1.5  # all equal: id 0
        x[4, V - 1] = 9.0  # the last id, in the short last chunk
        x[5, [500, 260, 900]] = 9.0  # the first of three, in the middle chunk
        got = ksampling.argmax_rows(x, chunk=256, block=64, impl="triton")
        out.append({"dtype": str(dtype), "equal": bool(torch.equal(got, torch.argmax(x, dim=-1))),
                    "tokens": got.tolist()})
    return out


def swiglu_cases():
    """kernels/gemm.swiglu_linear (fc1 + SwiGLU as one GEMM) against F.linear + the SwiGLU, fp32:
    rows and columns not multiples of the tiles, a K that is not a multiple of block_k (masked
    loads), grouped tile order over several m tiles, the default configs."""
    from hybridflow.kernels.gemm import Config, swiglu_linear

    g = torch.Generator().manual_seed(11)
    out = []
    for M, D, f, cfg in [(5, 64, 48, Config(16, 16, 32, 4, 2, 2)), (70, 96, 80, Config(16, 32, 64, 4, 2, 2)),
                         (3, 64, 96, None), (600, 32, 24, None)]:
        h = torch.randn(M, D, generator=g)
        fc1 = torch.randn(2 * f, D, generator=g) * 0.2
        gate, up = F.linear(h, fc1).chunk(2, dim=-1)
        ref = F.silu(gate) * up
        got = swiglu_linear(h, fc1, cfg=cfg, impl="triton")
        out.append({"shape": [M, D, f], "err": (got - ref).abs().max().item(),
                    "scale": ref.abs().max().item()})
    return out


def advance_cases():
    """kernels/next_token.advance_rows against the generator's PyTorch bookkeeping: drawn tokens with
    and without log-probs, and greedy partials (the argmax's pass 2 in the kernel); finished rows
    write pad / 0, stop tokens finish rows, more rows than one block (two row blocks)."""
    g = torch.Generator().manual_seed(13)
    out = []
    for B, with_lp, from_partials in [(7, True, False), (300, False, False), (300, False, True),
                                      (5, True, True)]:
        R, V, stops = 6, 1000, torch.tensor([5, 17])
        state = {"finished": torch.rand(B, generator=g) < 0.3,
                 "out_tokens": torch.randint(0, V, (B, R), generator=g),
                 "out_logprobs": torch.randn(B, R, generator=g),
                 "tokens": torch.randint(0, V, (B,), generator=g),
                 "positions": torch.randint(0, 50, (B,), generator=g),
                 "cur": torch.tensor([40]), "step": torch.tensor([3])}
        logits = torch.randn(B, V, generator=g)
        logits[::4, 17] = 9.0  # some rows draw a stop token
        tok = torch.argmax(logits, dim=-1)
        lp = torch.randn(B, generator=g)
        ref = {k: v.clone() for k, v in state.items()}  # the generator's ops
        step = int(ref["step"])
        ref["out_tokens"][:, step] = torch.where(ref["finished"], 0, tok)
        if with_lp:
            ref["out_logprobs"][:, step] = lp.masked_fill(ref["finished"], 0)
        ref["finished"] |= (tok[:, None] == stops).any(1)
        ref["tokens"].copy_(tok)
        for k in ("positions", "cur", "step"):
            ref[k] += 1
        got = {k: v.clone() for k, v in state.items()}
        kw = {k: got[k] for k in ("finished", "out_tokens", "tokens", "positions", "cur", "step")}
        if from_partials:
            kw.update(partials=ksampling.argmax_chunks(logits, chunk=256, block=64), vocab=V)
        else:
            kw.update(tok=tok)
        if with_lp:
            kw.update(lp=lp, out_logprobs=got["out_logprobs"])
        ksampling.advance_rows(stop_ids=stops, pad=0, **kw)
        out.append({"rows": B, "with_lp": with_lp, "from_partials": from_partials,
                    "equal": {k: bool(torch.equal(got[k], ref[k])) for k in ref},
                    "finished_now": int(got["finished"].sum())})
    return out


def prefill_cases():
    """rope_kv_prefill against its twin and against the decoder's own prefill RoPE (x cos +
    roll(x) sin; equal in fp32): q, and cache columns 0..S-1 of the given rows only."""
    out = []
    g = torch.Generator().manual_seed(1)
    for B, S, G, hpg, hd, T in [(3, 5, 2, 7, 64, 12), (2, 9, 1, 1, 16, 9), (2, 4, 4, 2, 32, 30)]:
        cache = torch.randn(2, 2, B + 2, G, T, hd, generator=g)  # (k/v, layer, rows, G, T, hd)
        before = cache.clone()
        kc, vc = cache[0, 1, 1:B + 1], cache[1, 1, 1:B + 1]  # rows 1..B of layer 1
        kc2, vc2 = kc.clone(), vc.clone()
        qkv = torch.randn(B, S, G, hpg + 2, hd, generator=g)
        cos_t, sin_t = tables(hd)
        pos = torch.randint(0, 200, (B, S), generator=g)
        cos, sin = cos_t[pos], sin_t[pos]
        q = kern.rope_kv_prefill(qkv, cos, sin, kc, vc, hpg=hpg, impl="triton")
        q2 = kern.rope_kv_prefill(qkv, cos, sin, kc2, vc2, hpg=hpg, impl="torch")
        qk = qkv[:, :, :, :hpg + 1]  # the decoder's torch prefill
        qk = qk * cos[:, :, None, None] + qk.roll(hd // 2, -1) * sin[:, :, None, None]
        changed = (cache != before).nonzero()
        out.append({"shape": [B, S, G, hpg, hd, T],
                    "q_err": (q - q2).abs().max().item(),
                    "q_vs_decoder": (q - qk[:, :, :, :hpg]).abs().max().item(),
                    "cache_err": max((kc - kc2).abs().max().item(), (vc - vc2).abs().max().item()),
                    "k_vs_decoder": (kc[:, :, :S] - qk[:, :, :, hpg].transpose(1, 2)).abs().max()
                    .item(),
                    "only_prefix_written": bool(
                        (changed[:, 1] == 1).all() and (changed[:, 2] >= 1).all()
                        and (changed[:, 2] <= B).all() and (changed[:, 4] < S).all()
                        and len(changed) > 0)})
    return out


def silu_mul_cases():
    """silu_mul against its twin (F.silu(gate) * up): widths below, at and above one block, and a
    strided row view."""
    g = torch.Generator().manual_seed(2)
    out = []
    for N, f in [(7, 37), (3, 1024), (2, 1500)]:
        z = torch.randn(N, 2 * f + 6, generator=g)[:, 3:2 * f + 3]  # rows of stride 2f + 6
        out.append({"shape": [N, f], "err": (kern.silu_mul(z, impl="triton")
                                             - kern.silu_mul(z, impl="torch")).abs().max().item()})
    return out


def add_rms_norm_cases():
    """add_rms_norm against its twin (x + y, then F.rms_norm): with and without the residual y,
    widths below and not a power of two, strided row views; the y-less call returns x itself."""
    g = torch.Generator().manual_seed(3)
    out = []
    for N, D, with_y in [(5, 64, True), (3, 96, True), (4, 200, False)]:
        x = torch.randn(N, D + 8, generator=g)[:, 4:D + 4]  # rows of stride D + 8
        y = torch.randn(N, D, generator=g) if with_y else None
        w = torch.rand(D, generator=g) + 0.5
        hk, ok = kern.add_rms_norm(x, y, w, 1e-6, impl="triton")
        ht, ot = kern.add_rms_norm(x, y, w, 1e-6, impl="torch")
        # rows gathered from a table (the decode step's embedding lookup in the first norm)
        table = torch.randn(11, D + 8, generator=g)[:, 2:D + 2]
        ids = torch.randint(0, 11, (N,), generator=g)
        gk, gok = kern.add_rms_norm(table, y, w, 1e-6, rows=ids, impl="triton")
        gt, got = kern.add_rms_norm(table[ids], y, w, 1e-6, impl="torch")
        gtw, gotw = kern.add_rms_norm(table, y, w, 1e-6, rows=ids, impl="torch")
        out.append({"shape": [N, D], "with_y": with_y, "h_err": (hk - ht).abs().max().item(),
                    "err": (ok - ot).abs().max().item(),
                    "h_is_x": hk.data_ptr() == x.data_ptr(),
                    "gather_h_err": (gk - gt).abs().max().item(),
                    "gather_err": (gok - got).abs().max().item(),
                    "gather_twin_equal": bool(torch.equal(gtw, gt) and torch.equal(gotw, got)),
                    "gather_h_is_copy": gk.data_ptr() != table.data_ptr()})
    return out


# head_dim 16, hpg 2, 2 query groups (1 per rank at TP_g = 2); test_rollout's vocabulary
CFG16 = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                    num_query_groups=2, vocab_size=37, add_qkv_bias=True)


def generation_cases():
    """The generator with decode_kernels=triton against torch: greedy tokens equal, log-probs close
    (fp32), with KV windows and compaction, and with n samples per prompt at T = 1; the defaults
    (these few rows: cuBLAS fc1 + silu_mul) and fc1 + SwiGLU as one Triton GEMM with every L2 hint
    asked for (a no-op off sm_90) and PDL off, with and without log-probs (greedy without them:
    the argmax's second pass in the bookkeeping kernel)."""
    cfg = CFG16
    out = {}
    for name, kw in {"greedy_window_compaction": dict(max_new_tokens=90, decode_kv_window=64,
                                                      compact_finished_rows=True),
                     # PyTorch's draws on both paths: the fused sampler (the default with the
                     # kernels) draws from its own stream (tests/unit/test_sample_rows.py)
                     "sampled_n3": dict(n=3, temperature=1.0, max_new_tokens=20,
                                        kernel_options=DecodeKernelOptions(fused_sampler=False)),
                     }.items():
        gen = make(cfg)
        generate = polled(gen, 4)
        ref = generate(PROMPTS, cfg=rc(**kw), eos_id=5, pad_id=0, seed=7)
        got = generate(PROMPTS, cfg=rc(**kw, decode_kernels="triton"), eos_id=5, pad_id=0, seed=7)
        compactions = gen.stats["compactions"]
        tri = rc(**kw, decode_kernels="triton")
        gemm_opts = opts(tri, check_every=4, swiglu_gemm_min_rows=0, prefetch_min_rows=0,
                         prefetch_weights=PREFETCHABLE, pdl=False)
        gm = gen.generate(PROMPTS, cfg=tri, eos_id=5, pad_id=0, seed=7, options=gemm_opts)
        nolp = gen.generate(PROMPTS, cfg=rc(**kw, decode_kernels="triton", return_logprobs=False),
                            eos_id=5, pad_id=0, seed=7, options=gemm_opts)
        # with prefill sub-batches of 8 tokens: [3], [7], [1], [5], each over its own columns
        own = gen.generate(PROMPTS, cfg=tri, eos_id=5, pad_id=0, seed=7,
                           options=opts(tri, check_every=4, own_columns_only=True,
                                        prefill_tokens=8))
        out[name] = {"gemm_tokens_equal": bool(torch.equal(ref.response_ids, gm.response_ids)),
                     "gemm_logprob_err": (ref.rollout_logprobs - gm.rollout_logprobs).abs().max()
                     .item(),
                     "gemm_no_logprobs_tokens_equal": bool(torch.equal(ref.response_ids,
                                                                       nolp.response_ids)),
                     "gemm_mask_equal": bool(torch.equal(ref.response_mask, gm.response_mask)),
                     "tokens_equal": bool(torch.equal(ref.response_ids, got.response_ids)),
                     "own_tokens_equal": bool(torch.equal(ref.response_ids, own.response_ids)),
                     "own_logprob_err": (ref.rollout_logprobs - own.rollout_logprobs).abs().max()
                     .item(),
                     "mask_equal": bool(torch.equal(ref.response_mask, got.response_mask)),
                     "logprob_err": (ref.rollout_logprobs - got.rollout_logprobs).abs().max().item(),
                     "compactions": compactions,
                     "tokens": int(ref.response_mask.sum())}
    return out


def launch_cases():
    """DecodeOptions.pdl reaches every Triton launch of a generate call (prefill, decode step,
    draw and bookkeeping), passed down as arguments: the `pdl` each kernel module hands
    launch_opts, recorded by a spy on that function, for pdl on and off."""
    from hybridflow.kernels import gemm

    modules = {"layer_ops": kern, "rope_attention": fused, "next_token": ksampling, "gemm": gemm}
    out = {}
    for pdl in (True, False):
        seen = {}

        def spy(name, real):
            def launch_opts(t, pdl_arg):
                seen.setdefault(name, set()).add(pdl_arg)
                return real(t, pdl_arg)
            return launch_opts

        patches = [mock.patch.object(m, "launch_opts", spy(n, m.launch_opts))
                   for n, m in modules.items()]
        for p in patches:
            p.start()
        try:
            gen = make(CFG16)
            cfg = rc(max_new_tokens=6, decode_kernels="triton", return_logprobs=False)
            gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0,
                         options=opts(cfg, pdl=pdl, swiglu_gemm_min_rows=0))
        finally:
            for p in patches:
                p.stop()
        out[str(pdl)] = {n: sorted(v) for n, v in seen.items()}
    return out


# Qwen3-shaped: q/k norms, head_dim 32 != hidden / heads, no QKV bias
CFG_QK = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                     num_query_groups=2, kv_channels=32, vocab_size=37, qk_layernorm=True)


def qk_norm_cases():
    """The q/k norm (Qwen3) fused into the RoPE kernels: rope_attention (1 and 2 splits, tables
    and positions) and rope_kv_prefill against their twins (output, caches), the prefill also
    against the decoder's own q/k norm + RoPE; the norm's effect on the output (that it is
    applied); the generator with decode_kernels=triton against torch for a qk_layernorm model."""
    from hybridflow.rollout.decoder import _qk_norm

    g = torch.Generator().manual_seed(6)
    decode, prefill = [], []
    for B, G, hpg, hd, T, kv in [(3, 2, 7, 64, 200, 150), (2, 2, 2, 32, 70, 70)]:
        cache = torch.randn(2, B, G, T, hd, generator=g)
        qkv = torch.randn(B, G, hpg + 2, hd, generator=g) * 3  # off unit scale: the norm matters
        qn, kn = torch.rand(hd, generator=g) + 0.5, torch.rand(hd, generator=g) + 0.5
        cos_t, sin_t = tables(hd)
        pos = torch.randint(0, 256, (B,), generator=g)
        cur = torch.tensor([kv // 2])
        valid = torch.rand(B, T, generator=g) < 0.5
        valid[:, kv // 2] = True
        norm = dict(q_norm=qn, k_norm=kn, eps=1e-6, positions=pos, hpg=hpg)
        ref_cache = cache.clone()
        ref = fused.rope_attention(qkv, cos_t, sin_t, ref_cache[0, :, :, :kv],
                                   ref_cache[1, :, :, :kv], cur, valid[:, :kv], impl="torch",
                                   **norm)
        plain = fused.rope_attention(qkv, cos_t, sin_t, cache[0, :, :, :kv].clone(),
                                     cache[1, :, :, :kv].clone(), cur, valid[:, :kv], hpg=hpg,
                                     positions=pos, impl="torch")
        err = cache_err = 0.0
        for splits in (1, 2):
            c = cache.clone()
            a = fused.rope_attention(qkv, cos_t, sin_t, c[0, :, :, :kv], c[1, :, :, :kv], cur,
                                     valid[:, :kv], splits=splits, impl="triton", **norm)
            err = max(err, (a - ref).abs().max().item())
            cache_err = max(cache_err, (c - ref_cache).abs().max().item())
        decode.append({"shape": [B, G, hpg, hd, T, kv], "attn_err": err, "cache_err": cache_err,
                       "norm_effect": (ref - plain).abs().max().item()})
        S = 5
        qkv = torch.randn(B, S, G, hpg + 2, hd, generator=g) * 3
        pos = torch.randint(0, 200, (B, S), generator=g)
        cos, sin = cos_t[pos], sin_t[pos]
        k1, v1, k2, v2 = (torch.zeros(B, G, 8, hd) for _ in range(4))
        q1 = kern.rope_kv_prefill(qkv, cos, sin, k1, v1, hpg=hpg, q_norm=qn, k_norm=kn, eps=1e-6,
                                  impl="triton")
        q2 = kern.rope_kv_prefill(qkv, cos, sin, k2, v2, hpg=hpg, q_norm=qn, k_norm=kn, eps=1e-6,
                                  impl="torch")
        qk = _qk_norm(qkv[:, :, :, :hpg + 1], qn, kn, 1e-6)  # the decoder's torch prefill
        qk = qk * cos[:, :, None, None] + qk.roll(hd // 2, -1) * sin[:, :, None, None]
        prefill.append({"shape": [B, S, G, hpg, hd], "q_err": (q1 - q2).abs().max().item(),
                        "cache_err": max((k1 - k2).abs().max().item(),
                                         (v1 - v2).abs().max().item()),
                        "q_vs_decoder": (q1 - qk[:, :, :, :hpg]).abs().max().item(),
                        "k_vs_decoder": (k1[:, :, :S] - qk[:, :, :, hpg].transpose(1, 2)).abs()
                        .max().item()})
    gen = make(CFG_QK)
    kw = dict(max_new_tokens=40, decode_kv_window=64, compact_finished_rows=True)
    ref = polled(gen, 4)(PROMPTS, cfg=rc(**kw), eos_id=5, pad_id=0, seed=7)
    got = polled(gen, 4)(PROMPTS, cfg=rc(**kw, decode_kernels="triton"), eos_id=5, pad_id=0,
                         seed=7)
    generation = {"tokens_equal": bool(torch.equal(ref.response_ids, got.response_ids)),
                  "mask_equal": bool(torch.equal(ref.response_mask, got.response_mask)),
                  "logprob_err": (ref.rollout_logprobs - got.rollout_logprobs).abs().max().item(),
                  "tokens": int(ref.response_mask.sum())}
    return {"decode": decode, "prefill": prefill, "generation": generation}


def _tp2_rank():
    """One rank of TP_g = 2 (gloo): the same shards generate with both decode_kernels values."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.parallel import groups, param_rules
    from hybridflow.rollout import Generator
    full = random_params(CFG16)  # vocab padded to 40 rows: 20 per TP rank
    groups.init_model_parallel(tp=2, pp=1, seed=0)
    group = ps.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    shards = {n: param_rules.shard_tensor(n, t, tp_rank=rank, tp_size=2).contiguous()
              for n, t in full.items()}
    gen = Generator(model_cfg=CFG16, params=shards, tp_group=group, device=torch.device("cpu"),
                    dtype=torch.float32, true_vocab_size=CFG16.vocab_size)
    out = {}
    for name, kw in {"greedy": dict(max_new_tokens=40, decode_kv_window=64,
                                    compact_finished_rows=True),
                     "sampled": dict(n=2, temperature=1.0, top_p=0.9, max_new_tokens=12)}.items():
        generate = polled(gen, 2)
        ref = generate(PROMPTS, cfg=rc(**kw), eos_id=5, pad_id=0, seed=3)
        got = generate(PROMPTS, cfg=rc(**kw, decode_kernels="triton"), eos_id=5, pad_id=0, seed=3)
        out[name] = {"tokens_equal": bool(torch.equal(ref.response_ids, got.response_ids)),
                     "logprob_err": (ref.rollout_logprobs - got.rollout_logprobs).abs().max().item(),
                     "tokens": int(ref.response_mask.sum())}
    return out


def tp2_cases():
    from tests.dist.launcher import run_ranks

    return run_ranks(_tp2_rank, 2)


def kv_fp8_cases():
    """rollout.kv_cache_dtype=fp8: rope_attention on an Fp8KV cache against its twins (write_column
    quantizing, decode_attention dequantizing): the same codes and scales at column cur (one column,
    and a column per row) and nothing else written, the output within fp32 rounding, with 1, 2 and
    one-per-block splits; and the generator with the kernels (the prefill's scratch pair
    quantized into the cache, windows, compaction) against the torch path, both on fp8 caches."""
    from hybridflow.kernels.kv_fp8 import Fp8KV, quantize_kv

    out = {"attention": [], "generation": {}}
    g = torch.Generator().manual_seed(5)
    for B, G, hpg, hd, T, per_row in [(3, 2, 7, 64, 200, False), (4, 1, 2, 32, 130, True)]:
        x = torch.randn(2, B, G, T, hd, generator=g) * 3
        codes, scale = quantize_kv(x)
        qkv = torch.randn(B, G, hpg + 2, hd, generator=g)
        cos_t, sin_t = tables(hd)
        # position 0 (cos 1, sin 0): k after RoPE is the projection's, bit for bit on both sides,
        # so the codes and scales must be too
        pos = torch.zeros(B, dtype=torch.long)
        cur = (torch.randint(0, T, (B,), generator=g) if per_row
               else torch.tensor([T // 2]))
        valid = torch.rand(B, T, generator=g) < 0.6

        def cache():
            return [Fp8KV(codes[i].clone(), scale[i].clone()) for i in range(2)]

        ref_k, ref_v = cache()
        ref = fused.rope_attention(qkv, cos_t, sin_t, ref_k, ref_v, cur, valid, hpg=hpg,
                                   positions=pos, impl="torch")
        case = {"shape": [B, G, hpg, hd, T], "per_row": per_row, "err": 0.0, "bits_equal": True,
                "only_cur_written": True}
        for target in (1, 2 * B * G, 10_000):
            k, v = cache()
            a = fused.rope_attention(qkv, cos_t, sin_t, k, v, cur, valid, hpg=hpg, positions=pos,
                                     splits=kern.num_splits(B * G, T, qkv.device, target=target),
                                     impl="triton")
            case["err"] = max(case["err"], (a - ref).abs().max().item())
            for got, want, before in ((k, ref_k, codes[0]), (v, ref_v, codes[1])):
                case["bits_equal"] &= bool(
                    torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
                    and torch.equal(got.scale, want.scale))
                cols = (got.codes.view(torch.uint8) != before.view(torch.uint8)).any(-1)
                written = cols.nonzero()
                case["only_cur_written"] &= bool(
                    (written[:, 2] == cur.expand(B)[written[:, 0]]).all())
        pos = torch.randint(0, 256, (B,), generator=g)  # RoPE'd k: equal to rounding
        ref_k, ref_v = cache()
        ref = fused.rope_attention(qkv, cos_t, sin_t, ref_k, ref_v, cur, valid, hpg=hpg,
                                   positions=pos, impl="torch")
        k, v = cache()
        a = fused.rope_attention(qkv, cos_t, sin_t, k, v, cur, valid, hpg=hpg, positions=pos,
                                 impl="triton")
        case["rope_err"] = (a - ref).abs().max().item()
        out["attention"].append(case)
    cfg = CFG16
    gen = make(cfg)
    for name, kw in {"greedy_window_compaction": dict(max_new_tokens=72, decode_kv_window=64,
                                                      compact_finished_rows=True),
                     "sampled_n3": dict(n=3, temperature=1.0, max_new_tokens=12,
                                        kernel_options=DecodeKernelOptions(fused_sampler=False)),
                     }.items():
        generate = polled(gen, 4)
        ref = generate(PROMPTS, cfg=rc(**kw, kv_cache_dtype="fp8"), eos_id=5, pad_id=0, seed=7)
        fcfg = rc(**kw, kv_cache_dtype="fp8", decode_kernels="triton")
        got = generate(PROMPTS, cfg=fcfg, eos_id=5, pad_id=0, seed=7)
        # own-column attention and prefill sub-batches over their own columns on the fp8 cache
        own = gen.generate(PROMPTS, cfg=fcfg, eos_id=5, pad_id=0, seed=7,
                           options=opts(fcfg, check_every=4, own_columns_only=True,
                                        prefill_tokens=8))
        out["generation"][name] = {
            "own_tokens_equal": bool(torch.equal(ref.response_ids, own.response_ids)),
            "own_logprob_err": (ref.rollout_logprobs - own.rollout_logprobs).abs().max().item(),
            "tokens_equal": bool(torch.equal(ref.response_ids, got.response_ids)),
            "mask_equal": bool(torch.equal(ref.response_mask, got.response_mask)),
            "logprob_err": (ref.rollout_logprobs - got.rollout_logprobs).abs().max().item(),
            "fp8_cache": bool(gen._cache.fp8), "compactions": gen.stats["compactions"],
            "tokens": int(ref.response_mask.sum())}
    return out


if __name__ == "__main__":
    print(json.dumps({"rope_attention": rope_attention_cases(), "own": own_columns_cases(),
                      "argmax": argmax_cases(),
                      "prefill": prefill_cases(), "swiglu": swiglu_cases(),
                      "advance": advance_cases(), "silu_mul": silu_mul_cases(),
                      "add_rms_norm": add_rms_norm_cases(), "generation": generation_cases(),
                      "qk_norm": qk_norm_cases(),
                      "launch": launch_cases(), "tp2": tp2_cases(), "kv_fp8": kv_fp8_cases()}))
