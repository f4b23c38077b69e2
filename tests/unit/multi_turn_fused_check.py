"""Run by tests/unit/test_multi_turn_fused.py in a fresh interpreter with TRITON_INTERPRET=1 (set
before the first import of the kernels; tests/unit/decode_kernels_check.py says why). Arguments:
the section ("kernels": rope_attention, decoder.decode_step and the step's scratch column;
"rollout": generate_multi_turn; "tp2": it at TP_g = 2) and a scratch directory. Prints one JSON object of results."""

import dataclasses
import json
import os
import pathlib
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hybridflow.config import RolloutConfig  # noqa: E402
from hybridflow.kernels import rope_attention as fused  # noqa: E402
from hybridflow.kernels.kv_fp8 import readable  # noqa: E402
from hybridflow.rollout import Generator, decoder  # noqa: E402
from hybridflow.rollout.kv_cache import KVCache  # noqa: E402
from hybridflow.rollout.multi_turn import generate_multi_turn  # noqa: E402
from hybridflow.rollout.multi_turn_step import DecodeState, decode_step  # noqa: E402
from hybridflow.rollout.options import DecodeOptions  # noqa: E402
from tests.unit.test_multi_turn import CFG, V, byte_tokenizer, call, params, tool_config  # noqa
from tests.unit.test_multi_turn_step import runner_for  # noqa: E402
from tests.unit.triton_interp import patch  # noqa: E402

patch()

# the kernels' head_dim: a power of two >= 16 (CFG's is 8); q/k norm and QKV bias on, as CFG
CFG16 = dataclasses.replace(CFG, kv_channels=16)
# the rollouts': one query group (the interpreter runs a program per row x group x split)
CFG16_G1 = dataclasses.replace(CFG16, num_query_groups=1)


def tables(hd, length=256):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    f = torch.outer(torch.arange(length).float(), inv)
    return torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)


def rope_attention_cases():
    """rope_attention with a column per row: all equal -> the (1,) path's bits (kernel and twin);
    distinct columns -> the twin (and the twin a per-row loop of the (1,) twin), each row's K/V at
    its own column only, mark_valid by rows marking only those."""
    g = torch.Generator().manual_seed(7)
    out = []
    for B, G, hpg, hd, T, kv, splits in [(4, 2, 3, 16, 200, 150, 1), (3, 1, 2, 32, 130, 130, 3)]:
        cache = torch.randn(2, B, G, T, hd, generator=g)
        qkv = torch.randn(B, G, hpg + 2, hd, generator=g)
        cos_t, sin_t = tables(hd)
        pos = torch.randint(0, 256, (B,), generator=g)
        valid = torch.rand(B, T, generator=g) < 0.6
        c = kv // 3

        def run(cur, kvalid, impl, mark=False, c0=cache):
            cc, vv = c0.clone(), kvalid.clone()
            a = fused.rope_attention(qkv, cos_t, sin_t, cc[0, :, :, :kv], cc[1, :, :, :kv], cur,
                                     vv[:, :kv], hpg=hpg, positions=pos, mark_valid=mark,
                                     splits=splits, impl=impl)
            return a, cc, vv

        same = {}
        for impl in ("triton", "torch"):
            one = run(torch.tensor([c]), valid, impl, mark=True)
            rows = run(torch.full((B,), c), valid, impl, mark=True)
            same[impl] = all(torch.equal(x, y) for x, y in zip(one, rows))
        cur = torch.randint(0, kv, (B,), generator=g)
        cur[0] = kv - 1  # the window's last column (the scratch column's place)
        mark = torch.arange(B) % 2 == 0  # rows 0, 2, ... marked
        base = valid.clone()
        base[torch.arange(B), cur] = False
        a, cc, vv = run(cur, base, "triton", mark=mark)
        ra, rc, rv = run(cur, base, "torch", mark=mark)
        # reference: each row alone through the (1,) twin at its own column
        loop_err = 0.0
        for b in range(B):
            lc = cache[:, b:b + 1].clone()
            la = fused.rope_attention(qkv[b:b + 1], cos_t, sin_t, lc[0, :, :, :kv],
                                      lc[1, :, :, :kv], cur[b:b + 1],
                                      base[b:b + 1, :kv].clone(), hpg=hpg, positions=pos[b:b + 1],
                                      mark_valid=True, impl="torch")
            loop_err = max(loop_err, (la[0] - ra[b]).abs().max().item(),
                           (lc[:, 0] - rc[:, b]).abs().max().item())
        changed = (cc != cache).any(-1).nonzero()  # (k/v, row, group, column)
        expect = {(k, b, gg, int(cur[b])) for k in range(2) for b in range(B) for gg in range(G)}
        want_valid = base.clone()
        want_valid[torch.arange(B)[mark], cur[mark]] = True
        # own columns with a column per row: row b's tokens are cur[b] - pos[b] .. cur[b] - 1;
        # every other column NaN and valid (never read), row 1 finished (reads none)
        lo = (torch.rand(B, generator=g) * (cur + 1)).long()
        own_pos = cur - lo
        cols = torch.arange(T)[None]
        mine = (cols >= lo[:, None]) & (cols < cur[:, None])
        fin = torch.zeros(B, dtype=torch.bool)
        fin[1] = True
        poisoned = cache.clone()
        outside = ~(mine & ~fin[:, None])
        poisoned[outside[None, :, None, :, None].expand_as(poisoned)] = float("nan")
        inside = valid & mine
        plain = fused.rope_attention(qkv, cos_t, sin_t, cache[0, :, :, :kv].clone(),
                                     cache[1, :, :, :kv].clone(), cur, inside[:, :kv].clone(),
                                     hpg=hpg, positions=own_pos, splits=splits, impl="triton")
        own = fused.rope_attention(qkv, cos_t, sin_t, poisoned[0, :, :, :kv].clone(),
                                   poisoned[1, :, :, :kv].clone(), cur,
                                   (inside | ~mine)[:, :kv].clone(), hpg=hpg, positions=own_pos,
                                   finished=fin, splits=splits, impl="triton")
        live = ~fin
        out.append({"shape": [B, G, hpg, hd, T, kv, splits], "same_as_shared": same,
                    "own_rows_bit_equal": bool(torch.equal(own[live], plain[live])),
                    "own_finished_finite": bool(torch.isfinite(own[fin]).all()),
                    "attn_err": (a - ra).abs().max().item(), "cache_err":
                    (cc - rc).abs().max().item(), "twin_vs_loop": loop_err,
                    "only_own_columns": {tuple(r) for r in changed.tolist()} == expect,
                    "marked_rows_only": bool(torch.equal(vv, want_valid)
                                             and torch.equal(rv, want_valid))})
    return out


def decoder_cases():
    """decoder.decode_step with a column per row (some rows unmarked): the fused layers against the
    torch path; logits, K/V and key_valid."""
    gen = Generator(model_cfg=CFG16, params=params(CFG16), tp_group=None, device="cpu",
                    dtype=torch.float32, true_vocab_size=V)
    B, T, kv = 5, 128, 96
    g = torch.Generator().manual_seed(3)
    cos, sin = decoder.rope_tables(gen.w.inv_freq, T, dtype=torch.float32, device="cpu")
    tokens = torch.randint(0, V, (B,), generator=g)
    cur = torch.tensor([10, 40, 95, 3, 60])
    positions = cur + torch.tensor([0, 2, 1, 0, 5])
    valid = torch.arange(T)[None] < cur[:, None]
    valid[1, :7] = False  # left padding
    mark = torch.tensor([1, 1, 0, 1, 0])
    res = {}
    for kernels in ("torch", "triton"):
        d = gen.w.dims
        cache = KVCache(num_layers=d.num_layers, rows=B, groups=d.groups, length=T,
                        head_dim=d.head_dim, dtype=torch.float32, device="cpu")
        torch.manual_seed(0)
        cache.k.normal_()
        cache.v.normal_()
        kvalid = valid.clone()
        lg = decoder.decode_step(gen.w, tokens, positions, cur, kvalid, cache=cache, cos_tab=cos,
                                 sin_tab=sin, kv_len=kv, opts=DecodeOptions(kernels=kernels),
                                 mark=mark)
        res[kernels] = (lg, cache.k.clone(), cache.v.clone(), kvalid)
    (lt, kt, vt, mt), (lf, kf, vf, mf) = res["torch"], res["triton"]
    want = valid.clone()
    want[torch.arange(B)[mark.bool()], cur[mark.bool()]] = True
    return {"logits_err": (lt - lf).abs().max().item(), "k_err": (kt - kf).abs().max().item(),
            "v_err": (vt - vf).abs().max().item(), "logits_scale": lt.abs().max().item(),
            "valid_torch": bool(torch.equal(mt, want)), "valid_triton": bool(torch.equal(mf, want))}


def scratch_cases():
    """multi_turn_step.decode_step on the fused layers: a non-ready row writes its K/V into the
    window's last column (L - 1), which never becomes valid; its column and position stay; a ready
    row's column becomes valid and both advance."""
    gen = Generator(model_cfg=CFG16, params=params(CFG16), tp_group=None, device="cpu",
                    dtype=torch.float32, true_vocab_size=V)
    gen._ensure_cache(rows=4, length=128)
    out = {}
    for kv_len in (None, 64):
        L = kv_len or 128
        st = DecodeState(4, 128, V, "cpu")
        st.logits.normal_(generator=torch.Generator().manual_seed(1))
        st.col.copy_(torch.tensor([5, 20, 9, 30]))
        st.pos.copy_(st.col)
        st.key_valid[:] = torch.arange(128)[None] < st.col[:, None]
        st.ctrl[DecodeState.READY] = torch.tensor([1, 0, 1, 0])
        before_valid, before_col = st.key_valid.clone(), st.col.clone()
        gen._cache.k.normal_(generator=torch.Generator().manual_seed(L))  # no stale equal K
        k_before = gen._cache.k.clone()
        fn = decode_step(gen, st, RolloutConfig(temperature=0.0), graphed=False, kv_len=kv_len,
                         opts=DecodeOptions(kernels="triton"))
        fn()
        ready = torch.tensor([True, False, True, False])
        want = before_valid.clone()
        want[[0, 2], before_col[[0, 2]]] = True
        wrote = (gen._cache.k != k_before).any(-1).any(0).any(1)  # (rows, T)
        out[str(kv_len)] = {
            "valid_ok": bool(torch.equal(st.key_valid, want)),
            "scratch_written": bool(wrote[1, L - 1] and wrote[3, L - 1]),
            "scratch_invalid": not bool(st.key_valid[[1, 3], L - 1].any()),
            "ready_at_own_column": bool(wrote[0, 5] and wrote[2, 9] and not wrote[0, L - 1]),
            "advanced": st.col.tolist() == (before_col + ready.long()).tolist()}
        fn()  # a second step: still nothing valid at the scratch column
        out[str(kv_len)]["scratch_invalid_after_two"] = not bool(st.key_valid[[1, 3], L - 1].any())
    return out


def rollout_cases(tmp):
    """generate_multi_turn with kernels="triton" against "torch" (forced tool calls, then greedy;
    KV windows, emulated graphs, with and without compaction): the same tokens and tool masks,
    log-probs within rounding, the K/V equal where valid (without compaction: the state's rows
    are then the cache's; compaction moves both runs' rows alike). "fed": the triton run feeds
    the tool results through the decode step (rollout.multi_turn.append=decode), the torch run
    appends them by `extend`: the same conversation and cache; "fp8_fed", "fp8_windows" and
    "fp8_compaction" the same on an fp8 KV cache (rollout.kv_cache_dtype=fp8: both round what they
    write; K/V compared dequantized)."""
    tok = byte_tokenizer(tmp)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("6*7?", "a longer question")]
    forced = [tok.encode(call("6*7")) + tok.encode("42") + end, end, tok.encode("ab") + end,
              tok.encode(call("1+1"))]  # the last: greedy after its result, to the budget
    path = tool_config(tmp, "calculator")
    out = {}
    for name, compact, append in (("windows", False, "prefill"), ("compaction", True, "prefill"),
                                  ("fed", False, "decode"), ("fed_ahead", False, "ahead"),
                                  ("fp8_fed", False, "decode"), ("fp8_windows", False, "prefill"),
                                  ("fp8_compaction", True, "prefill")):
        # fed: room for the results to be appended (at 84 tokens they end the rows)
        cfg = RolloutConfig(n=2, max_new_tokens=200 if "fed" in name else 84, temperature=0.0,
                            return_logprobs=True, max_batch_size=4,
                            kv_cache_dtype="fp8" if name.startswith("fp8") else "auto")
        runs = {}
        for kernels in ("torch", "triton"):
            gen = Generator(model_cfg=CFG16_G1, params=params(CFG16_G1), tp_group=None,
                            device="cpu", dtype=torch.float32, true_vocab_size=V)
            opts = DecodeOptions(kernels=kernels, prefill_tokens=64, kv_window=64,
                                 compact_finished_rows=compact, min_graphed_bucket=1,
                                 emulate_graphs=True)
            batch, m = generate_multi_turn(
                gen, prompts, cfg=cfg, eos_id=tok.eos_id,
                runner=runner_for(tok, "hermes", path,
                                  append=("decode" if append == "ahead" else append)
                                  if kernels == "triton" else "prefill",
                                  lookahead=append == "ahead" and kernels == "triton"),
                pad_id=tok.pad_id, seed=3, forced=forced, options=opts)
            (st, _), = [v for k, v in gen._steps.items() if k[0] == "multi_turn" and k[1] == 4]
            runs[kernels] = (batch, m, gen, st)
        (b0, m0, g0, s0), (b1, m1, g1, s1) = runs["torch"], runs["triton"]
        kv_err = None
        if not compact:
            kv_err = 0.0
            for c0, c1 in ((g0._cache.k, g1._cache.k), (g0._cache.v, g1._cache.v)):
                c0, c1 = readable(c0, torch.float32), readable(c1, torch.float32)
                for b in range(4):
                    cols = s0.key_valid[b].nonzero()[:, 0]
                    kv_err = max(kv_err, (c0[:, b, :, cols] - c1[:, b, :, cols]).abs().max()
                                 .item())
        out[name] = {
            "tokens_equal": bool(torch.equal(b0.response_ids, b1.response_ids)),
            "tool_mask_equal": bool(torch.equal(b0.tool_mask, b1.tool_mask)),
            "tool_tokens": int(b0.tool_mask.sum()), "tokens": int(b0.response_mask.sum()),
            "logprob_err": (b0.rollout_logprobs - b1.rollout_logprobs).abs().max().item(),
            "valid_equal": bool(torch.equal(s0.key_valid, s1.key_valid)), "kv_err": kv_err,
            "compactions": [m0["multi_turn/compactions"], m1["multi_turn/compactions"]],
            "kv_columns_mean": [m0["multi_turn/kv_columns_mean"],
                                m1["multi_turn/kv_columns_mean"]],
            "steps": [m0["multi_turn/decode_steps"], m1["multi_turn/decode_steps"]],
            "append_calls": [m0["multi_turn/append_calls"], m1["multi_turn/append_calls"]],
            "fed_tool_tokens": m1["multi_turn/fed_tool_tokens"], "fp8": bool(g1._cache.fp8)}
    return out


def _tp2_rank(tmp):
    """One rank of TP_g = 2 (gloo, one query group per rank): the same shards run the multi-turn
    rollout with both decode_kernels values (forced calls, then greedy; windows)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.parallel import groups, param_rules

    groups.init_model_parallel(tp=2, pp=1, seed=0)
    group = ps.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    tmp = pathlib.Path(tmp) / f"rank{rank}"
    tmp.mkdir(parents=True)
    tok = byte_tokenizer(tmp)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("6*7?", "x")]
    forced = [tok.encode(call("6*7")) + tok.encode("42") + end, tok.encode("ab")]
    path = tool_config(tmp, "calculator")
    shards = {n: param_rules.shard_tensor(n, t, tp_rank=rank, tp_size=2).contiguous()
              for n, t in params(CFG16).items()}
    cfg = RolloutConfig(n=1, max_new_tokens=72, temperature=0.0, return_logprobs=True,
                        max_batch_size=2)
    runs = {}
    for kernels in ("torch", "triton"):
        gen = Generator(model_cfg=CFG16, params=shards, tp_group=group, device="cpu",
                        dtype=torch.float32, true_vocab_size=V)
        runs[kernels], _ = generate_multi_turn(
            gen, prompts, cfg=cfg, runner=runner_for(tok, "hermes", path), eos_id=tok.eos_id,
            pad_id=tok.pad_id, seed=3, forced=forced,
            options=DecodeOptions(kernels=kernels, prefill_tokens=64, kv_window=64))
    ref, got = runs["torch"], runs["triton"]
    return {"tokens_equal": bool(torch.equal(ref.response_ids, got.response_ids)),
            "tool_mask_equal": bool(torch.equal(ref.tool_mask, got.tool_mask)),
            "tool_tokens": int(ref.tool_mask.sum()), "tokens": int(ref.response_mask.sum()),
            "logprob_err": (ref.rollout_logprobs - got.rollout_logprobs).abs().max().item()}


def tp2_cases(tmp):
    from tests.dist.launcher import run_ranks

    return run_ranks(_tp2_rank, 2, str(tmp))


if __name__ == "__main__":
    section, tmp = sys.argv[1], pathlib.Path(sys.argv[2])
    if section == "kernels":
        res = {"rope_attention": rope_attention_cases(), "decoder": decoder_cases(),
               "scratch": scratch_cases()}
    elif section == "rollout":
        res = rollout_cases(tmp)
    else:
        res = tp2_cases(tmp)
    print(json.dumps(res))
