"""Speculative sampling of generation's tail (hybridflow/rollout/speculative.py) on CPU: the n-gram
drafter against a brute-force search, the acceptance rule's output distribution against the target
distribution (many rows at once), and whole generations with a long tail: greedy output equal to
plain decoding, sampled log-probs equal to a cache-free forward over the emitted tokens (the
rejected drafts' cache columns were overwritten or never read), seeded reproducibility, the graphed
path's host side (emulated) and the config checks."""

import dataclasses

import pytest
import torch

from hybridflow.config import Config, RolloutConfig, SpeculativeConfig
from hybridflow.config_checks import validate_speculative
from hybridflow.rollout import decoder
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.speculative import NgramDrafter, accept
from tests.unit.test_compaction import random_prompts, uneven_stops
from tests.unit.test_rollout import CFG, make, opts, rc


def brute_draft(ctx: list, k: int, sizes: list) -> list:
    for n in sizes:
        if len(ctx) < n:
            continue
        for start in range(len(ctx) - n - 1, -1, -1):  # the last earlier occurrence
            if ctx[start:start + n] == ctx[len(ctx) - n:]:
                c, period = start + n, len(ctx) - start - n
                return [ctx[c + j % period] for j in range(k)]
    return []


def test_drafter_matches_brute_force_lookup():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        vocab = int(torch.randint(2, 6, (1,), generator=g))
        seq = torch.randint(0, vocab, (60,), generator=g).tolist()
        d = NgramDrafter([seq[:5]], ngram_max=3, ngram_min=1)
        for t in range(5, len(seq)):
            assert d.draft(0, 4) == brute_draft(seq[:t], 4, [3, 2, 1]), (trial, t)
            d.append(0, [seq[t]])
        # contexts indexed at construction: the index the token-by-token appends build
        whole = NgramDrafter([seq, seq[:1], []], ngram_max=3, ngram_min=1)
        assert whole.index[0] == d.index[0] and whole.ctx[0] == d.ctx[0]
        for t in range(len(seq)):
            assert NgramDrafter([seq[:t]], ngram_max=3, ngram_min=1).draft(0, 4) == \
                brute_draft(seq[:t], 4, [3, 2, 1])
    d = NgramDrafter([[7, 8, 9]], ngram_max=2, ngram_min=2)
    assert d.draft(0, 3) == []  # no earlier occurrence of [8, 9]
    d = NgramDrafter([[1, 2, 3, 1, 2]], ngram_max=2, ngram_min=1)
    assert d.draft(0, 5) == [3, 1, 2, 3, 1]  # the loop continues past the context's end
    assert d.draft(0, 0) == []


def _distribution(x: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(x, minlength=V).double() / x.numel()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_accept_samples_the_target_distribution(top_k, top_p):
    """N rows with the same logits and drafts: the first emitted token is distributed as p_0
    (filtered as the sampler filters), the second (given the first draft was kept) as p_1, and
    a row with no drafts emits p_0's sample."""
    N, V, T = 40000, 6, 0.8
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, V, generator=g) * 1.5
    logits = base.expand(N, 3, V).contiguous()
    drafts = torch.tensor([2, 4]).expand(N, 2).contiguous()
    for n_draft in (2, 0):
        emitted, kept, lp = accept(logits, drafts, torch.full((N,), n_draft), temperature=T,
                                   top_k=top_k, top_p=top_p,
                                   generator=torch.Generator().manual_seed(2))
        target = []
        for j in range(3):
            from hybridflow.rollout.sampling import filter_logits

            values, ids = filter_logits(base[j:j + 1] / T, top_k=top_k, top_p=top_p)
            p = torch.softmax(values, -1)
            target.append(p[0] if ids is None else torch.zeros(V).scatter_(0, ids[0], p[0]))
        tol = lambda p, n: 4.5 * (p * (1 - p) / n).sqrt() + 1e-3  # noqa: E731
        first = _distribution(emitted[:, 0], V)
        assert (first - target[0]).abs().le(tol(target[0], N)).all(), (first, target[0])
        if n_draft == 0:
            assert (kept == 0).all()
            continue
        after = kept >= 1  # the first draft (2) was kept: the second token is p_1's
        assert abs(after.double().mean() - target[0][2]) < 0.01
        second = _distribution(emitted[after, 1], V)
        n = int(after.sum())
        assert (second - target[1].double()).abs().le(tol(target[1].double(), n)).all()
        # log-probs: log_softmax(logits / T) at the emitted token, before any filtering
        full = torch.log_softmax(base / T, -1)
        assert torch.allclose(lp[:, 0], full[0][emitted[:, 0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfiltered_accept_is_the_filtered_paths_math(dtype):
    """Without top-k / top-p, accept reads the logits once (log-sum-exp and the drafts' logits)
    and races over the kept position's row: on the same draws it keeps the drafts and draws the
    tokens the softmax path does (p / E against x / T - log E), with the same log-probs."""
    from hybridflow.rollout.sampling import draw

    r, S, V, T = 64, 5, 1000, 0.7
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(r, S, V, generator=g) * 2).to(dtype)
    drafts = torch.randint(0, V, (r, S - 1), generator=g)
    drafts[: r // 2] = logits[: r // 2, :-1].float().argmax(-1)  # likely kept
    n_draft = torch.randint(0, S, (r,), generator=g)
    emitted, kept, lp = accept(logits, drafts, n_draft, temperature=T, top_k=0, top_p=1.0,
                               generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(logits.float() / T, -1)
    p_draft = probs[:, :-1].gather(2, drafts[..., None]).squeeze(-1)
    u = torch.rand((r, S - 1), generator=gen)
    want_kept = ((u < p_draft) & (torch.arange(S - 1) < n_draft[:, None])).int().cumprod(1).sum(1)
    p = probs.gather(1, want_kept[:, None, None].expand(r, 1, V)).squeeze(1)
    bad = drafts.gather(1, want_kept.clamp(max=S - 2)[:, None])
    p = p.masked_fill((want_kept < n_draft)[:, None] & (torch.arange(V) == bad), 0.0)
    last = draw(p, gen)
    assert torch.equal(kept, want_kept) and 0 < int(kept.sum())
    assert torch.equal(emitted[torch.arange(r), kept], last)
    for i in range(r):
        assert emitted[i, :kept[i]].tolist() == drafts[i, :kept[i]].tolist()
    want_lp = torch.log_softmax(logits.float() / T, -1).gather(2, emitted[..., None]).squeeze(-1)
    assert torch.allclose(lp, want_lp, atol=1e-5, rtol=0)


def test_accept_greedy_keeps_the_argmax_prefix():
    logits = torch.zeros(3, 4, 5)
    best = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [0, 0, 0, 0]])
    logits.scatter_(2, best[..., None], 5.0)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 0, 0]])
    emitted, kept, _ = accept(logits, drafts, torch.tensor([3, 3, 1]), temperature=0.0, top_k=0,
                              top_p=1.0)
    assert kept.tolist() == [3, 1, 1]  # all; up to the mismatch; capped by n_draft
    assert emitted[0].tolist() == [1, 2, 3, 4]
    assert emitted[1, :2].tolist() == [1, 0]
    assert emitted[2, :2].tolist() == [0, 0]


def _long_tail(seed: int = 1, num: int = 12, R: int = 40):
    gen = make()
    prompts = random_prompts(num, vocab=CFG.vocab_size, seed=seed)
    free = gen.generate(prompts, cfg=rc(max_new_tokens=R), eos_id=-1, pad_id=0, seed=0)
    stops = uneven_stops(free.response_ids, [0, 5], CFG.vocab_size)
    return gen, prompts, stops


def _run(gen, prompts, cfg, spec_rows, seed=0, **kw):
    o = opts(cfg, check_every=2, spec_rows=spec_rows, **kw)
    return gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=99, seed=seed, options=o)


@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_output_unchanged(graphs):
    gen, prompts, stops = _long_tail()
    cfg = rc(max_new_tokens=40, stop_token_ids=stops, max_batch_size=16,
             compact_finished_rows=graphs)
    kw = dict(emulate_graphs=graphs, spec_draft_tokens=3)
    plain = _run(gen, prompts, cfg, 0, **kw)
    spec = _run(gen, prompts, cfg, 4, **kw)
    stats = dict(gen.stats)
    lengths = plain.response_mask.sum(1)
    assert (lengths == 40).sum() == 2 and (lengths < 10).sum() >= 6  # a long tail
    assert stats["spec_steps"] > 0 and stats["spec_tokens"] > stats["spec_steps"]
    assert torch.equal(spec.response_ids, plain.response_ids)
    assert torch.equal(spec.response_mask, plain.response_mask)
    assert torch.allclose(spec.rollout_logprobs, plain.rollout_logprobs, atol=1e-5, rtol=0)


def _forward_logprobs(gen, batch, i: int, T: float) -> tuple:
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 128, dtype=torch.float32, device="cpu")
    p = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
    n = int(batch.response_mask[i].sum())
    seq = p + batch.response_ids[i, :n].tolist()
    ids = torch.tensor([seq])
    lg = decoder.forward(gen.w, ids, torch.arange(len(seq))[None], torch.ones_like(ids).bool(),
                         cos_tab=cos, sin_tab=sin)[0]
    lp = torch.log_softmax(lg.float() / T, -1)[len(p) - 1:len(seq) - 1]
    lp = lp.gather(1, torch.tensor(seq[len(p):])[:, None]).squeeze(1)
    return lp, batch.rollout_logprobs[i, :n]


@pytest.mark.parametrize("top_p,graphs", [(1.0, False), (0.9, True)])
def test_sampled_rows_are_consistent_with_the_model(top_p, graphs):
    """Every emitted token's log-prob equals a cache-free forward over the final sequence: the
    tail fed each row the tokens it emitted, at the right columns and positions, whatever was
    rejected in between. Seeded runs reproduce; stops and masks are well formed."""
    gen, prompts, stops = _long_tail(seed=2)
    T = 0.7
    cfg = rc(max_new_tokens=40, temperature=T, top_p=top_p, n=2, stop_token_ids=stops[:3],
             max_batch_size=32, compact_finished_rows=graphs)
    kw = dict(emulate_graphs=graphs)
    a = _run(gen, prompts, cfg, 8, seed=5, **kw)
    stats = dict(gen.stats)
    b = _run(gen, prompts, cfg, 8, seed=5, **kw)
    c = _run(gen, prompts, cfg, 8, seed=6, **kw)
    assert stats["spec_steps"] > 0 and stats["spec_drafted"] > 0
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    lengths = a.response_mask.sum(1)
    for i in range(a.batch_size):
        got, want = _forward_logprobs(gen, a, i, T)
        assert torch.allclose(got, want, atol=2e-5, rtol=0), i
        row, n = a.response_ids[i].tolist(), int(lengths[i])
        hits = [j for j, t in enumerate(row[:n]) if t in stops[:3]]
        assert n == (hits[0] + 1 if hits else 40)
        assert all(t == 99 for t in row[n:]) and (a.rollout_logprobs[i, n:] == 0).all()


def test_tail_respects_max_new_tokens_and_short_budgets():
    gen, prompts, stops = _long_tail(seed=3)
    for R in (3, 7):  # the tail may start one step before the end
        cfg = rc(max_new_tokens=R, stop_token_ids=stops, max_batch_size=16)
        plain = _run(gen, prompts, cfg, 0)
        spec = _run(gen, prompts, cfg, 16, spec_draft_tokens=6)
        assert torch.equal(spec.response_ids, plain.response_ids)
        assert spec.response_ids.shape[1] <= R


def test_options_and_config_checks():
    r = RolloutConfig(speculative=SpeculativeConfig(enable=True, max_rows=8, draft_tokens=5,
                                                    ngram_max=4, ngram_min=2))
    o = DecodeOptions.from_config(r)
    assert (o.spec_rows, o.spec_draft_tokens, o.spec_ngram) == (8, 5, (4, 2))
    assert DecodeOptions.from_config(RolloutConfig()).spec_rows == 0
    validate_speculative(r)
    bad = [(dict(draft_tokens=0), "rollout.speculative.draft_tokens"),
           (dict(max_rows=-1), "rollout.speculative.max_rows"),
           (dict(ngram_max=1, ngram_min=2), "rollout.speculative.ngram_max")]
    for change, key in bad:
        cfg = dataclasses.replace(r, speculative=dataclasses.replace(r.speculative, **change))
        with pytest.raises(ValueError, match=key):
            validate_speculative(cfg)
    with pytest.raises(ValueError, match="rollout.multi_turn.enable"):
        validate_speculative(dataclasses.replace(
            r, multi_turn=dataclasses.replace(r.multi_turn, enable=True)))
    with pytest.raises(ValueError, match="rollout.quantization"):
        validate_speculative(dataclasses.replace(r, quantization="fp8"))
    Config()  # the default config carries the group, off
    assert Config().rollout.speculative.enable is None  # auto: config_auto decides


def test_metrics_sum_over_a_steps_calls():
    from hybridflow.rollout.speculative import speculative_metrics

    m = speculative_metrics({"spec_steps": 3, "spec_rows": 10, "spec_drafted": 40,
                             "spec_tokens": 30}, into={})
    assert m["rollout/spec_tokens_per_row_step"] == 3.0 and m["rollout/spec_draft_kept"] == 0.5
    speculative_metrics({"spec_steps": 1, "spec_rows": 2, "spec_drafted": 0, "spec_tokens": 2},
                        into=m)  # a second generate call of the step (dynamic sampling)
    assert (m["rollout/spec_steps"], m["rollout/spec_row_steps"]) == (4, 12)
    assert m["rollout/spec_tokens_per_row_step"] == 32 / 12
    assert m["rollout/spec_draft_kept"] == (32 - 12) / 40
    empty = speculative_metrics({"spec_steps": 0, "spec_rows": 0, "spec_drafted": 0,
                                 "spec_tokens": 0}, into={})
    assert empty["rollout/spec_tokens_per_row_step"] == 0.0


def test_several_chunks_share_the_tail_step():
    """max_batch_size below the rows: each chunk runs its own tail on the one captured step."""
    gen, prompts, stops = _long_tail(seed=1)
    cfg = rc(max_new_tokens=40, stop_token_ids=stops, max_batch_size=5)
    plain = _run(gen, prompts, cfg, 0, emulate_graphs=True)
    spec = _run(gen, prompts, cfg, 4, emulate_graphs=True)
    assert gen.stats["spec_steps"] > 0
    assert sum(k[0] == "speculative" for k in gen._steps) == 1
    assert torch.equal(spec.response_ids, plain.response_ids)
    assert torch.allclose(spec.rollout_logprobs, plain.rollout_logprobs, atol=1e-5, rtol=0)


def test_without_logprobs_and_with_top_k():
    """return_logprobs false (no log-prob pass in the tail); top_k = 1 at temperature 1 (a draw
    that cannot change the token: the sampled path's output equals greedy decoding's)."""
    gen, prompts, stops = _long_tail(seed=5)
    cfg = rc(max_new_tokens=40, stop_token_ids=stops, max_batch_size=16, return_logprobs=False)
    plain = _run(gen, prompts, cfg, 0)
    spec = _run(gen, prompts, cfg, 4)
    assert gen.stats["spec_steps"] > 0 and spec.rollout_logprobs is None
    assert torch.equal(spec.response_ids, plain.response_ids)
    topk1 = dataclasses.replace(cfg, temperature=1.0, top_k=1)
    assert torch.equal(_run(gen, prompts, topk1, 4, seed=9).response_ids, plain.response_ids)


@pytest.mark.parametrize("model, rollout", [
    ({}, {}),
    ({}, {"kv_cache_dtype": "fp8"}),
    ({}, {"quantization": "fp8"}),
    ({}, {"quantization": "int4"}),
    ({}, {"decode_kernels": "torch"}),
    ({"qk_layernorm": True}, {}),
])
def test_auto_tail_rule_is_the_run_time_rule(model, rollout):
    """config_auto decides from the config what fused_verify_applies decides from the built
    generator: auto turns the tail on only where the fused step runs (widths of 128 so that int4
    can quantize); a q/k-norm model runs it fused too, but auto leaves it off (not measured)."""
    from hybridflow.config import load_config
    from hybridflow.config_auto import _speculative_tail_applies
    from hybridflow.rollout.generator import Generator
    from hybridflow.rollout.speculative import fused_verify_applies
    from tests.unit.test_quantized_rollout import QCFG
    from tests.unit.test_rollout import random_params

    base = load_config([])
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, **model),
                              rollout=dataclasses.replace(base.rollout, **rollout))
    mc = dataclasses.replace(QCFG, **model)
    gen = Generator(model_cfg=mc, params=random_params(mc), tp_group=None,
                    device=torch.device("cpu"), dtype=torch.float32, true_vocab_size=37,
                    quantization=cfg.rollout.quantization)
    gen._ensure_cache(rows=2, length=16, fp8=cfg.rollout.kv_cache_dtype == "fp8")
    kernels = "torch" if cfg.rollout.decode_kernels == "torch" else "triton"  # as on a GPU
    o = DecodeOptions.from_config(cfg.rollout).replace(kernels=kernels)
    assert fused_verify_applies(gen, o) is (_speculative_tail_applies(cfg) or bool(model))
    assert _speculative_tail_applies(cfg) is (not model and not rollout)
