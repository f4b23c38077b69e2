"""Generator on CPU (TP_g = 1, random weights under Megatron names): cache vs recompute, ragged
left padding, EOS/stop handling and masks, padded vocab, n > 1 ordering, chunking, seeding, one
prefill per prompt for its n copies."""

import dataclasses

import pytest
import torch

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.rollout import Generator, decoder
from hybridflow.rollout.options import DecodeOptions

CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=37, add_qkv_bias=True)
V_PAD = 40  # padded rows get huge logits: sampling them would show at once
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [30, 2, 2, 7, 1]]


def random_params(cfg: ModelConfig, *, seed: int = 0, tied: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.3: torch.randn(*s, generator=g) * std  # noqa: E731
    D, hd = cfg.hidden_size, cfg.head_dim
    G, H, F = cfg.num_query_groups, cfg.num_attention_heads, cfg.ffn_hidden_size
    p = {"embedding.word_embeddings.weight": r(V_PAD, D, std=1.0),
         "decoder.final_layernorm.weight": 1 + r(D, std=0.1)}
    if not tied:
        p["output_layer.weight"] = r(V_PAD, D)
        p["output_layer.weight"][cfg.vocab_size:] = 100.0
    for i in range(cfg.num_layers):
        q = f"decoder.layers.{i}."
        p[q + "input_layernorm.weight"] = 1 + r(D, std=0.1)
        p[q + "pre_mlp_layernorm.weight"] = 1 + r(D, std=0.1)
        p[q + "self_attention.linear_qkv.weight"] = r(G * (H // G + 2) * hd, D)
        p[q + "self_attention.linear_qkv.bias"] = r(G * (H // G + 2) * hd, std=0.1)
        p[q + "self_attention.linear_proj.weight"] = r(D, H * hd)
        p[q + "mlp.linear_fc1.weight"] = r(2 * F, D)
        p[q + "mlp.linear_fc2.weight"] = r(D, F)
        if cfg.qk_layernorm:
            p[q + "self_attention.q_layernorm.weight"] = 1 + r(hd, std=0.3)
            p[q + "self_attention.k_layernorm.weight"] = 1 + r(hd, std=0.3)
    return p


def make(cfg=CFG, **kw):
    return Generator(model_cfg=cfg, params=random_params(cfg, **kw), tp_group=None,
                     device=torch.device("cpu"), dtype=torch.float32,
                     true_vocab_size=cfg.vocab_size)


def rc(**kw):
    base = dict(max_new_tokens=9, temperature=0.0, return_logprobs=True)
    return RolloutConfig(**{**base, **kw})


def opts(cfg: RolloutConfig, **kw) -> DecodeOptions:
    """cfg's decode options with some fields changed (e.g. check_every, not a config key)."""
    return DecodeOptions.from_config(cfg).replace(**kw)


def polled(gen, every: int):
    """gen.generate with its stop polls (and compaction decisions) every `every` decode steps."""
    def generate(prompts, *, cfg, **kw):
        return gen.generate(prompts, cfg=cfg, options=opts(cfg, check_every=every), **kw)
    return generate


def recompute_greedy(gen, prompt, steps):
    """No cache: a full forward over the growing sequence at every step."""
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 128, dtype=torch.float32, device="cpu")
    seq, lps = list(prompt), []
    for _ in range(steps):
        ids = torch.tensor([seq])
        lg = decoder.forward(gen.w, ids, torch.arange(len(seq))[None], torch.ones_like(ids).bool(),
                             cos_tab=cos, sin_tab=sin)[0, -1]
        seq.append(int(lg.argmax()))
        lps.append(float(torch.log_softmax(lg, -1)[seq[-1]]))
    return seq[len(prompt):], torch.tensor(lps)


def test_cache_matches_recompute_on_ragged_batch():
    gen = make()
    out = gen.generate(PROMPTS, cfg=rc(), eos_id=-1, pad_id=0, seed=0)
    assert out.response_ids.shape == (4, 9) and out.prompt_ids.shape == (4, 7)
    assert out.prompt_mask.sum(1).tolist() == [len(p) for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        assert out.prompt_ids[i, 7 - len(p):].tolist() == p  # left padded
        toks, lps = recompute_greedy(gen, p, 9)
        assert out.response_ids[i].tolist() == toks
        assert torch.allclose(out.rollout_logprobs[i], lps, atol=1e-5)
        alone = gen.generate([p], cfg=rc(), eos_id=-1, pad_id=0, seed=0)  # padding changes nothing
        assert torch.equal(alone.response_ids[0], out.response_ids[i])
    assert out.response_ids.max() < CFG.vocab_size  # padded vocab (logit 100) never chosen


def test_tied_embeddings_and_padded_vocab_never_sampled():
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
    gen = make(cfg, tied=True)
    out = gen.generate(PROMPTS, cfg=rc(), eos_id=-1, pad_id=0, seed=0)
    assert out.response_ids[1].tolist() == recompute_greedy(gen, PROMPTS[1], 9)[0]
    gen = make()
    out = gen.generate(PROMPTS * 8, cfg=rc(temperature=1.5, max_new_tokens=16), eos_id=-1,
                       pad_id=0, seed=1)
    assert out.response_ids.max() < CFG.vocab_size


def test_eos_stop_tokens_and_masks():
    gen = make()
    free = gen.generate(PROMPTS, cfg=rc(), eos_id=-1, pad_id=0, seed=0).response_ids
    eos, stop = int(free[0, 2]), int(free[2, 4])
    out = gen.generate(PROMPTS, cfg=rc(stop_token_ids=[stop]), eos_id=eos, pad_id=99, seed=0)
    for i in range(len(PROMPTS)):
        row = free[i].tolist()
        hits = [j for j, t in enumerate(row) if t in (eos, stop)]
        n = hits[0] + 1 if hits else 9
        assert out.response_mask.sum(1)[i] == n
        assert out.response_mask[i].tolist() == [1] * n + [0] * (out.response_mask.shape[1] - n)
        assert out.response_ids[i, :n].tolist() == row[:n]
        assert (out.response_ids[i, n:] == 99).all() and (out.rollout_logprobs[i, n:] == 0).all()
    assert out.response_ids.shape[1] == int(out.response_mask.sum(1).max())  # R = longest produced
    assert (out.prompt_ids[out.prompt_mask == 0] == 99).all()


def test_early_exit_when_all_rows_finished():
    gen = make()
    free = gen.generate(PROMPTS, cfg=rc(), eos_id=-1, pad_id=0, seed=0).response_ids
    cfg = rc(max_new_tokens=40, stop_token_ids=free[:, 1].tolist())
    out = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0,
                       options=opts(cfg, check_every=2))
    assert out.response_mask.sum(1).max() <= 2 and out.response_ids.shape[1] <= 2
    buf, _ = next(v for k, v in gen._steps.items() if k[1] == 40)  # stopped long before 40
    assert int(buf.step) <= 1 + 3 * 2


def test_n_ordering_seeding_and_chunking():
    gen = make()
    cfg = rc(temperature=1.0, top_p=0.95, n=3, max_new_tokens=6)
    a = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=5)
    assert a.prompt_ids.shape[0] == 12
    for i in range(12):  # rows [p0s0, p0s1, p0s2, p1s0, ...]
        assert torch.equal(a.prompt_ids[i], a.prompt_ids[(i // 3) * 3])
    assert not torch.equal(a.response_ids[0], a.response_ids[1])  # the samples differ
    b = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=5)
    c = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=6)
    assert torch.equal(a.response_ids, b.response_ids) and torch.allclose(a.rollout_logprobs, b.rollout_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    greedy = rc(n=2)
    whole = gen.generate(PROMPTS, cfg=greedy, eos_id=-1, pad_id=0, seed=0)
    chunked = gen.generate(PROMPTS, cfg=dataclasses.replace(greedy, max_batch_size=3), eos_id=-1,
                           pad_id=0, seed=0)
    assert torch.equal(whole.response_ids, chunked.response_ids)
    assert torch.equal(whole.response_ids[0], whole.response_ids[1])
    gen.release()
    assert gen._cache is None and not gen._steps
    again = gen.generate(PROMPTS, cfg=greedy, eos_id=-1, pad_id=0, seed=0)  # usable after release
    assert torch.equal(again.response_ids, whole.response_ids)



def prefills(gen) -> tuple:
    """(prefill sub-batches, prompt rows prefilled) of the generator's last call."""
    return gen.stats["prefills"], gen.stats["prefill_rows"]


def per_row_prefill(gen, prompts, cfg, share_prefill=False, **kw):
    """The reference: each prompt repeated n times as n = 1 prompts, the same rows
    [p0s0, p0s1, ..., p1s0, ...] with every row prefilled on its own (share_prefill: equal
    prompts side by side share their prefill, the default)."""
    rows = [p for p in prompts for _ in range(cfg.n)]
    cfg = dataclasses.replace(cfg, n=1)
    options = kw.pop("options", None) or opts(cfg)
    return gen.generate(rows, cfg=cfg, options=options.replace(share_prefill=share_prefill), **kw)


def assert_same_rows(a, b):
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # bit-equal on CPU fp32 as well; allclose leaves room for a BLAS that rounds by batch size
    assert torch.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefill_shared_by_n_copies_matches_per_row_prefill(temperature):
    gen = make()
    cfg = rc(n=4, temperature=temperature, top_p=0.9, max_new_tokens=12)
    ref = per_row_prefill(gen, PROMPTS, cfg, eos_id=-1, pad_id=0, seed=3)
    assert prefills(gen) == (1, 16)  # the reference does prefill every row
    shared = per_row_prefill(gen, PROMPTS, cfg, share_prefill=True, eos_id=-1, pad_id=0, seed=3)
    assert prefills(gen) == (1, 4)  # equal n = 1 prompts side by side: one prefill per run
    assert_same_rows(shared, ref)
    out = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=3)
    assert prefills(gen) == (1, 4)  # once per prompt
    # the first draw has the same (B, V) shape as with per-row prefill: same random stream, so
    # sampled outputs are identical too, not only equally distributed
    assert_same_rows(out, ref)
    assert out.group_ids.tolist() == [i for i in range(4) for _ in range(4)]
    if temperature:  # the n copies still sample independently
        assert len({tuple(r) for r in out.response_ids[:4].tolist()}) > 1
    else:
        assert (out.response_ids == out.response_ids[::4].repeat_interleave(4, 0)).all()


def test_prefill_batches_by_hand():
    from hybridflow.rollout.generator import prefill_batches

    # 8-token budget: [3, 7] at width 7 would be 14 tokens; [4, 2, 1] 3 x 4 = 12 > 8 -> [4, 2]
    # at 4 (8 tokens), then [1, 9]: 2 x 9 > 8 -> [1], [9] alone (one prompt at least)
    assert prefill_batches([3, 7, 4, 2, 1, 9], 8) == [(0, 1, 3), (1, 2, 7), (2, 4, 4),
                                                      (4, 5, 1), (5, 6, 9)]
    assert prefill_batches([2, 2, 2], 100) == [(0, 3, 2)]


def test_prefill_sub_batches_over_their_own_width():
    """Prefill sub-batches of prompts of very different lengths each run over their own widest
    prompt's columns (the rest of the cache columns is left padding): the same rows as one
    sub-batch over every column. With rollout.kernel_options.prefill_width_multiple each width is
    rounded up (the prompts left-padded for it, capped where the cache would grow): the same rows
    again, the returned prompts without the added columns."""
    gen = make()
    prompts = [[7] * 40, [3, 4], [5, 6, 7], [9] * 33, [1]]
    for temperature in (0.0, 1.0):
        cfg = rc(n=2, temperature=temperature, max_new_tokens=10)
        whole = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=5,
                             options=opts(cfg, prefill_tokens=10_000))
        assert prefills(gen) == (1, 5)
        out = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=5,
                           options=opts(cfg, prefill_tokens=40))
        assert prefills(gen) == (4, 5)  # [40], [2, 3] at width 3, [33], [1] (2 x 33 > 40)
        assert_same_rows(out, whole)
        for multiple in (16, 10_000):
            out = gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=5,
                               options=opts(cfg, prefill_tokens=100,
                                            prefill_width_multiple=multiple))
            assert out.prompt_ids.shape == (10, 40)
            assert_same_rows(out, whole)
    # never a longer KV cache than the call's own (P + R in 64-column steps): 40 + 10 -> 64
    # columns, so at most 54 prompt columns whatever the multiple
    assert gen._cache.length == 64


def test_prefill_batches_rounded_widths_by_hand():
    from hybridflow.rollout.generator import prefill_batches

    # widths rounded up to 4 columns, at most 9: [3] at 4 ([3, 7] at 8 would be 16 tokens), [7]
    # at 8, [4, 2] at 4, [1] at 4 ([1, 9]: 2 x 9 > 8), [9] at 9 (the limit, not 12)
    assert prefill_batches([3, 7, 4, 2, 1, 9], 8, 4, 9) == [(0, 1, 4), (1, 2, 8), (2, 4, 4),
                                                            (4, 5, 4), (5, 6, 9)]
    # the rounding counts against the budget: [2, 2, 2] at 4 is 12 > 8 tokens -> [2, 2], [2]
    assert prefill_batches([2, 2, 2], 8, 4) == [(0, 2, 4), (2, 3, 4)]
    assert prefill_batches([5, 3], 128, 64, 300) == [(0, 2, 64)]


def test_prefill_sharing_across_a_chunk_boundary():
    """n = 3, max_batch_size = 4: chunks [p0 p0 p0 p1] [p1 p1 p2 p2] [p2 p3 p3 p3] cut p1 and p2."""
    gen = make()
    for temperature in (0.0, 1.0):
        cfg = rc(n=3, max_batch_size=4, temperature=temperature, max_new_tokens=12,
                 compact_finished_rows=True)
        polls = opts(cfg, check_every=2)
        ref = per_row_prefill(gen, PROMPTS, cfg, eos_id=5, pad_id=0, seed=4, options=polls)
        out = gen.generate(PROMPTS, cfg=cfg, eos_id=5, pad_id=0, seed=4, options=polls)
        assert prefills(gen) == (3, 6)  # each chunk prefills its two distinct prompts
        assert gen.stats["compactions"] > 0  # compaction moves the copied K/V rows as any others
        assert_same_rows(out, ref)
        assert out.group_ids.tolist() == [i for i in range(4) for _ in range(3)]
    whole = gen.generate(PROMPTS, cfg=rc(n=3), eos_id=-1, pad_id=0, seed=0)
    chunked = gen.generate(PROMPTS, cfg=rc(n=3, max_batch_size=4), eos_id=-1, pad_id=0, seed=0)
    assert torch.equal(whole.response_ids, chunked.response_ids)


def test_prefill_sub_batches_count_distinct_prompts():
    gen = make()
    cfg = rc(n=5)
    # longest prompt 7: 2 rows a sub-batch
    out = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0,
                       options=opts(cfg, prefill_tokens=2 * 7))
    assert prefills(gen) == (2, 4)  # 4 distinct prompts, not 20 rows
    ref = per_row_prefill(gen, PROMPTS, rc(n=5), eos_id=-1, pad_id=0, seed=0)
    assert_same_rows(out, ref)


def test_prompts_left_padded_from_any_int_sequences():
    """The host-side packing of the prompts (numpy, one pass over the ids): lists, tuples, tensors
    and arrays of different lengths, each ending at the last column, pad ids before it."""
    import numpy as np

    gen = make()
    prompts = [[5, 6, 7], (8,), torch.tensor([9, 10]), np.array([11, 12, 13, 14])]
    ids, mask = gen._padded_prompts(prompts, rc(), pad_id=3)
    assert ids.tolist() == [[3, 5, 6, 7], [3, 3, 3, 8], [3, 3, 9, 10], [11, 12, 13, 14]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_user_errors():
    gen = make()
    with pytest.raises(ValueError, match="non-empty"):
        gen.generate([[1], []], cfg=rc(), eos_id=0, pad_id=0, seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        gen.generate([[1, 37]], cfg=rc(), eos_id=0, pad_id=0, seed=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        gen.generate([[1]], cfg=rc(max_new_tokens=400), eos_id=0, pad_id=0, seed=0)
    params = random_params(CFG)
    del params["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match="layers.1.mlp.linear_fc2"):
        Generator(model_cfg=CFG, params=params, tp_group=None, device=torch.device("cpu"),
                  dtype=torch.float32, true_vocab_size=CFG.vocab_size)
