"""Run by tests/unit/test_spec_attention.py in a fresh interpreter with TRITON_INTERPRET=1 (set
before the first import of the kernels). Prints one JSON object of results."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hybridflow.config import DecodeKernelOptions  # noqa: E402

from hybridflow.kernels.next_token import accept_advance_tail, advance_tail  # noqa: E402
from hybridflow.kernels.spec_attention import rope_attention_multi  # noqa: E402
from hybridflow.rollout.speculative import TailState, accept, unfiltered_draws  # noqa: E402
from tests.unit.decode_kernels_check import CFG16, CFG_QK, tables  # noqa: E402
from tests.unit.test_compaction import random_prompts, uneven_stops  # noqa: E402
from tests.unit.test_rollout import make, opts, rc  # noqa: E402
from tests.unit.triton_interp import patch  # noqa: E402

patch()


def kernel_cases():
    """The kernel against its twin: 3 rows of S = 4 new tokens (one row with all valid, one with
    2, one finished), left-padded cached columns, random key_valid holes, 1 / 2 / one-per-block
    splits; the outputs of the valid tokens, the cache after the writes, the marks."""
    g = torch.Generator().manual_seed(0)
    out = []
    for G, hpg, hd, T, splits in ((2, 2, 16, 128, 1), (2, 3, 32, 128, 2), (1, 4, 16, 192, 3)):
        B, S = 3, 4
        qkv = torch.randn(B, S, G, hpg + 2, hd, generator=g)
        kc = torch.randn(B, G, T, hd, generator=g)
        vc = torch.randn(B, G, T, hd, generator=g)
        cos, sin = tables(hd, 256)
        col = torch.tensor([40, 70, 100])
        pos = torch.tensor([30, 65, 90])  # first real columns 10, 5, 10
        n_valid = torch.tensor([4, 2, 3])
        finished = torch.tensor([False, False, True])
        key_valid = torch.rand(B, T, generator=g) < 0.8
        res = {}
        for impl in ("triton", "torch"):
            k, v, kv = kc.clone(), vc.clone(), key_valid.clone()
            a = rope_attention_multi(qkv, cos, sin, k, v, col, pos, n_valid, finished, kv,
                                     mark=True, splits=splits, impl=impl)
            res[impl] = (a, k, v, kv)
        (a, k, v, kv), (ta, tk, tv, tkv) = res["triton"], res["torch"]
        ok = (torch.arange(S)[None] < n_valid[:, None]) & ~finished[:, None]
        written = torch.zeros(B, T, dtype=torch.bool)
        for b in range(B):
            if not finished[b]:
                written[b, col[b]:col[b] + n_valid[b]] = True
        out.append({"shape": [G, hpg, hd, T], "splits": splits,
                    "attn_err": (a - ta)[ok].abs().max().item(),
                    "cache_err": max((k - tk).abs().max().item(), (v - tv).abs().max().item()),
                    "only_written": bool(torch.equal(k.ne(kc).any(-1).any(1), written)
                                         and torch.equal(v.ne(vc).any(-1).any(1), written)),
                    "marks_equal": bool(torch.equal(kv, tkv)),
                    "marks_are_written": bool(torch.equal(kv, key_valid | written))})
    return out


def advance_cases():
    """kernels/next_token.advance_tail against its PyTorch twin on random tail states: rows
    finished before the step, stops among and past the kept tokens, rows at the output length,
    drafts rejected (their cache columns unmarked) and a cache ending inside a row's drafts; with
    and without log-probs. Every state tensor compared after the step."""
    out = []
    g = torch.Generator().manual_seed(7)
    for rows, S, with_lp in ((6, 5, True), (5, 9, False), (3, 2, True)):
        R, T = 20, 24
        st = TailState(rows, S, R, T, torch.device("cpu"))
        st.pend.random_(0, 50, generator=g)
        st.pos.random_(0, 30, generator=g)
        st.col.copy_(torch.tensor([4, 10, T - 2, 7, 0, 15][:rows]))  # row 2: drafts past T
        st.out_step.copy_(torch.tensor([3, R - 2, 5, R - 1, 0, 9][:rows]))
        st.finished.copy_(torch.tensor([False, False, False, False, True, False][:rows]))
        st.key_valid.copy_(torch.rand(rows, T, generator=g) < 0.8)
        st.n_draft.random_(0, S, generator=g)
        st.out_tokens.random_(0, 50, generator=g)
        st.out_logprobs.uniform_(-3, 0, generator=g)
        emitted = torch.randint(0, 12, (rows, S), generator=g)
        kept = torch.minimum(torch.randint(0, S, (rows,), generator=g), st.n_draft)
        lp = torch.rand(rows, S, generator=g) - 1 if with_lp else None
        stop_ids = torch.tensor([3, 11])
        states = []
        for impl in ("torch", "triton"):
            t = TailState(rows, S, R, T, torch.device("cpu"))
            for name, v in vars(st).items():
                getattr(t, name).copy_(v)
            advance_tail(t, emitted, kept, lp, stop_ids, impl=impl)
            states.append(t)
        a, b = states
        out.append({"rows": rows, "S": S, "lp": with_lp,
                    "differ": [n for n in vars(a) if not torch.equal(getattr(a, n), getattr(b, n))],
                    # live rows finished this step before the output length: cut at a stop
                    "stopped": int((a.finished & ~st.finished & (a.out_step < R)).sum()),
                    "unmarked": int((st.key_valid & ~a.key_valid).sum())})
    return out


def race_cases():
    """kernels/next_token.accept_advance_tail against the PyTorch acceptance (`accept`, unfiltered
    sampling) and bookkeeping on the same random draws: per row one id far ahead (most drafts,
    mostly kept) and two runners-up (stop tokens), so that the race is decided among a few ids,
    with and without the rejected draft left out; the vocabulary over several chunks, finished
    rows, stops and a row at the output length. Every tail-state tensor compared (log-probs to
    rounding)."""
    out = []
    g = torch.Generator().manual_seed(11)
    for rows, S, V, temp, with_lp, lead in ((5, 4, 300, 1.0, True, 9.0),
                                            (4, 6, 1000, 0.7, True, 9.0),
                                            (3, 2, 200, 1.3, False, 9.0),
                                            (6, 3, 300, 1.0, True, 5.7)):
        R, T = 16, 40
        logits = torch.randn(rows, S, V, generator=g)
        hot = torch.randint(0, V, (rows, 3), generator=g)
        boost = torch.tensor([lead, 6.0, 6.0]).expand(rows, S, 3).contiguous()
        logits.scatter_add_(2, hot[:, None, :].expand(rows, S, 3), boost)
        st = TailState(rows, S, R, T, torch.device("cpu"))
        st.pend.random_(0, V, generator=g)
        st.pos.random_(0, 20, generator=g)
        st.col.copy_(torch.tensor([3, 9, 20, 5, 11, 14][:rows]))
        st.out_step.copy_(torch.tensor([2, R - 1, 6, 0, 4, 1][:rows]))
        st.finished.copy_(torch.tensor([False, False, True, False, False, False][:rows]))
        st.key_valid.copy_(torch.rand(rows, T, generator=g) < 0.8)
        st.n_draft.random_(0, S, generator=g)
        st.drafts.copy_(torch.where(torch.rand(rows, S - 1, generator=g) < 0.7,
                                    hot[:, :1].expand(rows, S - 1),
                                    torch.randint(0, V, (rows, S - 1), generator=g)))
        stop_ids = hot[:, 1].unique()  # the runner-up where a draft of the hot id is rejected
        states = []
        for side in ("torch", "triton"):
            t = TailState(rows, S, R, T, torch.device("cpu"))
            for name, v in vars(st).items():
                getattr(t, name).copy_(v)
            rng = torch.Generator().manual_seed(5)
            if side == "torch":
                em, kept, lp = accept(logits, t.drafts, t.n_draft, temperature=temp, top_k=0,
                                      top_p=1.0, generator=rng, need_logprobs=with_lp)
                advance_tail(t, em, kept, lp, stop_ids, impl="torch")
                kept_torch = kept
            else:
                padded = torch.cat([t.drafts, t.drafts.new_zeros(rows, 1)], 1)
                draws = unfiltered_draws(logits, padded, inv_temp=1 / temp, generator=rng)
                accept_advance_tail(t, logits, draws, stop_ids, inv_temp=1 / temp,
                                    need_logprobs=with_lp, chunk=128, block=64)
                # rows whose rejected draft would have won the race had it not been left out
                at = logits[torch.arange(rows), kept_torch].float() / temp - draws[4]
                bad = t.drafts.gather(1, kept_torch.clamp(max=S - 2)[:, None]).squeeze(1)
                would_win = int(((kept_torch < st.n_draft) & (at.argmax(1) == bad)).sum())
            states.append(t)
        a, b = states
        out.append({"rows": rows, "S": S, "V": V, "lp": with_lp,
                    "differ": [n for n in vars(a) if n != "out_logprobs"
                               and not torch.equal(getattr(a, n), getattr(b, n))],
                    "logprob_err": (a.out_logprobs - b.out_logprobs).abs().max().item(),
                    "kept_drafts": int(kept_torch.sum()),
                    "rejected": int((kept_torch < st.n_draft).sum()),
                    "all_kept": int(((kept_torch == st.n_draft) & (st.n_draft > 0)).sum()),
                    "rejected_would_win": would_win,
                    "stopped": int((a.finished & ~st.finished & (a.out_step < R)).sum())})
    return out


def generation_cases():
    """The speculative tail on the decode kernels (verify_fused) against the PyTorch tail and
    plain decoding: greedy tokens equal, log-probs close; sampled: the fused tail's log-probs
    equal a cache-free forward (checked by the caller's tolerance)."""
    gen = make(CFG16)
    prompts = random_prompts(6, vocab=CFG16.vocab_size, seed=4)
    free = gen.generate(prompts, cfg=rc(max_new_tokens=24), eos_id=-1, pad_id=0, seed=0)
    stops = uneven_stops(free.response_ids, [0, 3], CFG16.vocab_size)
    out = {}
    # sampled: PyTorch's draws on both paths (the fused sampler draws from its own stream);
    # recipe: the GPU's way (graphed buckets emulated, compaction down to 1 row, a KV window);
    # both with the tail's bookkeeping as one kernel (spec_fused_advance, the default), the others
    # with the PyTorch bookkeeping after the fused verify
    cases = {"greedy": ({}, dict(spec_fused_advance=False)),
             "sampled": (dict(temperature=0.8, n=2,
                              kernel_options=DecodeKernelOptions(fused_sampler=False)),
                         dict(spec_fused_advance=True)),
             "recipe": (dict(compact_finished_rows=True, decode_kv_window=64),
                        dict(emulate_graphs=True, min_graphed_bucket=1, spec_fused_advance=True)),
             # Qwen3's q/k norms (last: it swaps the generator; the same prompts and stops)
             "qk_norm": ({}, dict(emulate_graphs=True, min_graphed_bucket=1,
                                  spec_fused_advance=False))}
    for name, (kw, okw) in cases.items():
        res = {}
        if name == "qk_norm":
            gen = make(CFG_QK)
            free = gen.generate(prompts, cfg=rc(max_new_tokens=24), eos_id=-1, pad_id=0, seed=0)
            stops = uneven_stops(free.response_ids, [0, 3], CFG_QK.vocab_size)
        for side, dk, rows in (("plain", "torch", 0), ("tail_torch", "torch", 4),
                               ("tail_fused", "triton", 4)):
            c = rc(max_new_tokens=24, stop_token_ids=stops, max_batch_size=32,
                   decode_kernels=dk, **kw)
            res[side] = gen.generate(prompts, cfg=c, eos_id=-1, pad_id=0, seed=3,
                                     options=opts(c, check_every=2, spec_rows=rows,
                                                  spec_draft_tokens=3, **okw))
            res[side + "_stats"] = dict(gen.stats)
        p, t, f = res["plain"], res["tail_torch"], res["tail_fused"]
        out[name] = {"fused_steps": res["tail_fused_stats"]["spec_steps"],
                     "fused_tokens": res["tail_fused_stats"]["spec_tokens"],
                     "fused_equals_torch_tail": bool(torch.equal(f.response_ids, t.response_ids)),
                     "fused_equals_plain": bool(torch.equal(f.response_ids, p.response_ids)),
                     "logprob_err": ((f.rollout_logprobs - t.rollout_logprobs).abs().max().item()
                                     if f.rollout_logprobs.shape == t.rollout_logprobs.shape
                                     else float("inf"))}
    return out


if __name__ == "__main__":
    print(json.dumps({"kernel": kernel_cases(), "advance": advance_cases(), "race": race_cases(),
                      "generation": generation_cases()}))
