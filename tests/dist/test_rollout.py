"""Generator against Megatron's GPTModel (TP=1) and TP_g=2 against TP_g=1, in one 2-rank spawn.

Per rank: build the tiny actor with `build_model` (TP=PP=1) (weights re-drawn with a larger scale
so greedy choices are clear-cut), greedy-decode with the GPTModel itself (full forward per step) and
with our Generator over `dict(model.named_parameters())`; then re-initialise TP=2 and run the
Generator over `param_rules.shard_tensor` shards of the same full dict (vocab padded with rows of
huge logits, which must never be sampled), greedy and sampled, beside the TP=1 Generator; and with
row compaction at every other step over very uneven stop lengths: TP_g=2 compacted == TP_g=1
uncompacted (greedy), TP_g=2 == TP_g=1 compacted (sampled), the same decisions on both ranks; and
TP_g=2 with the prefill widths rounded up to 16 columns == TP_g=1 at its own widths (sampled).
"""

import dataclasses

import torch

from hybridflow.config import ModelConfig, RolloutConfig
from tests.dist.launcher import run_ranks

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, vocab_size=63, add_qkv_bias=True)
SAME_LEN = [[3, 14, 15, 9, 2], [6, 5, 35, 8, 9], [7, 9, 3, 2, 3]]
RAGGED = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [30, 2, 2, 7, 1]]
STEPS = 8


def _greedy(**kw):
    return RolloutConfig(max_new_tokens=STEPS, temperature=0.0, return_logprobs=True, **kw)


def _gen(params, group, true_vocab=CFG.vocab_size):
    from hybridflow.rollout import Generator

    return Generator(model_cfg=CFG, params=params, tp_group=group, device=torch.device("cpu"),
                     dtype=torch.float32, true_vocab_size=true_vocab)


def _our_logits(gen, ids):
    from hybridflow.rollout import decoder

    cos, sin = decoder.rope_tables(gen.w.inv_freq, 64, dtype=torch.float32, device="cpu")
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return decoder.forward(gen.w, ids, pos, torch.ones_like(ids).bool(), cos_tab=cos, sin_tab=sin)


def _ranks_fn():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.models.build import build_model
    from hybridflow.parallel import groups, param_rules

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)
    model = build_model(CFG, role="actor", ctx=ctx).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "layernorm" in name else
                    torch.randn_like(p) * (1.0 if "embedding" in name else 0.3))
    res = {}
    # (1) Megatron greedy, recomputing the full sequence each step
    seq = torch.tensor(SAME_LEN)
    with torch.no_grad():
        for _ in range(STEPS):
            pos = torch.arange(seq.shape[1]).expand_as(seq)
            logits = model(seq, pos, attention_mask=None)[:, -1, :CFG.vocab_size]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        mg_logits = model(seq, torch.arange(seq.shape[1]).expand_as(seq),
                          attention_mask=None)[..., :CFG.vocab_size]
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen1 = _gen(dict(model.named_parameters()), None)
    out = gen1.generate(SAME_LEN, cfg=_greedy(), eos_id=-1, pad_id=0, seed=0)
    P = len(SAME_LEN[0])
    mg_lp = torch.log_softmax(mg_logits[:, P - 1:-1], -1).gather(2, seq[:, P:, None])[..., 0]
    res["mg"] = dict(mg_tokens=seq[:, P:], tokens=out.response_ids, lp=out.rollout_logprobs, mg_lp=mg_lp,
                     mg_logits=mg_logits, logits=_our_logits(gen1, seq))

    # (2) TP=2 over shards of the same weights, vocab padded 63 -> 64 with huge-logit rows
    pad_rows = lambda t: torch.cat([t, torch.full_like(t[:1], 50.0)])  # noqa: E731
    full = {n: pad_rows(t) if param_rules.param_rule(n) == param_rules.VOCAB else t
            for n, t in full.items()}
    sampled = RolloutConfig(max_new_tokens=STEPS, temperature=1.0, top_k=20, top_p=0.9, n=2,
                            return_logprobs=True)
    ref = _gen(full, None)
    ctx = groups.init_model_parallel(tp=2, pp=1, seed=0)
    group = ps.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    shards = {n: param_rules.shard_tensor(n, t, tp_rank=rank, tp_size=2).contiguous()
              for n, t in full.items()}
    gen2 = _gen(shards, group)
    eos = int(ref.generate(RAGGED, cfg=_greedy(), eos_id=-1, pad_id=0, seed=0).response_ids[0, 3])
    for name, cfg in (("greedy", _greedy()), ("sampled", sampled),
                      ("chunked", dataclasses.replace(sampled, max_batch_size=3))):
        res[name] = dict(tp1=ref.generate(RAGGED, cfg=cfg, eos_id=eos, pad_id=0, seed=3),
                         tp2=gen2.generate(RAGGED, cfg=cfg, eos_id=eos, pad_id=0, seed=3))
    # TP_g=2 with the prefill widths rounded up (left padding) against TP_g=1 at its own widths
    from hybridflow.rollout.options import DecodeOptions

    rounded = DecodeOptions.from_config(sampled).replace(prefill_width_multiple=16)
    res["rounded"] = dict(tp1=ref.generate(RAGGED, cfg=sampled, eos_id=eos, pad_id=0, seed=3),
                          tp2=gen2.generate(RAGGED, cfg=sampled, eos_id=eos, pad_id=0, seed=3,
                                            options=rounded))
    ids = torch.tensor([RAGGED[1]])
    res["logits"] = dict(tp1=_our_logits(ref, ids), tp2=_our_logits(gen2, ids))
    res["compact"] = _compaction(ref, gen2)
    return res


def _compaction(ref, gen2) -> dict:
    from tests.unit.test_compaction import random_prompts, uneven_stops
    from tests.unit.test_rollout import polled

    ref_gen, gen2_gen = polled(ref, 2), polled(gen2, 2)  # stop polls every 2 steps
    prompts, R = random_prompts(12, vocab=CFG.vocab_size), 24
    greedy = dataclasses.replace(_greedy(), max_new_tokens=R, max_batch_size=8,
                                 compact_finished_rows=True)
    free = ref_gen(prompts, cfg=greedy, eos_id=-1, pad_id=0, seed=0).response_ids
    stops = uneven_stops(free, [2, 7], CFG.vocab_size)  # rows 2 and 7 never stop
    greedy = dataclasses.replace(greedy, stop_token_ids=stops)
    sampled = dataclasses.replace(greedy, temperature=1.0, top_p=0.9, n=2,
                                  stop_token_ids=stops[:10])
    off = dataclasses.replace(greedy, compact_finished_rows=False)
    out = {"tp1_off": ref_gen(prompts, cfg=off, eos_id=-1, pad_id=0, seed=0)}
    out["tp2_on"] = gen2_gen(prompts, cfg=greedy, eos_id=-1, pad_id=0, seed=0)
    out["tp2_stats"] = dict(gen2.stats)
    out["tp1_sampled"] = ref_gen(prompts, cfg=sampled, eos_id=-1, pad_id=0, seed=5)
    out["tp2_sampled"] = gen2_gen(prompts, cfg=sampled, eos_id=-1, pad_id=0, seed=5)
    out["tp2_sampled_stats"] = dict(gen2.stats)
    return out


def test_generator_matches_megatron_and_tp2_matches_tp1():
    r0, r1 = run_ranks(_ranks_fn, 2)
    mg = r0["mg"]
    assert torch.equal(mg["tokens"], mg["mg_tokens"])  # greedy tokens: ours == GPTModel's
    assert torch.allclose(mg["logits"], mg["mg_logits"], atol=1e-5, rtol=0)
    assert torch.allclose(mg["lp"], mg["mg_lp"], atol=1e-5, rtol=0)  # cached decode's log-probs
    for name in ("greedy", "sampled", "chunked", "rounded"):
        tp1, tp2 = r0[name]["tp1"], r0[name]["tp2"]
        assert torch.equal(tp1.response_ids, tp2.response_ids), name
        assert torch.equal(tp1.response_mask, tp2.response_mask), name
        assert torch.allclose(tp1.rollout_logprobs, tp2.rollout_logprobs, atol=1e-5, rtol=0), name
        assert tp2.response_ids.max() < CFG.vocab_size  # the padded id (logit 50) never drawn
        # every TP_g rank drew the same tokens
        assert torch.equal(r1[name]["tp2"].response_ids, tp2.response_ids), name
    assert r0["greedy"]["tp2"].response_mask.sum(1)[0] == 4  # eos stops row 0 at step 4
    # the rounded prefill's added columns are not in the returned prompts
    assert torch.equal(r0["rounded"]["tp1"].prompt_ids, r0["rounded"]["tp2"].prompt_ids)
    assert torch.allclose(r0["logits"]["tp1"], r0["logits"]["tp2"], atol=1e-5, rtol=0)
    c, c1 = r0["compact"], r1["compact"]
    lengths = c["tp1_off"].response_mask.sum(1)
    assert (lengths == 24).sum() == 2 and (lengths < 8).sum() >= 6  # a long tail
    for stats in ("tp2_stats", "tp2_sampled_stats"):
        assert c[stats]["compactions"] >= 1 and c[stats] == c1[stats], stats  # same decisions
    assert torch.equal(c["tp1_off"].response_ids, c["tp2_on"].response_ids)
    assert torch.equal(c["tp1_off"].response_mask, c["tp2_on"].response_mask)
    assert torch.allclose(c["tp1_off"].rollout_logprobs, c["tp2_on"].rollout_logprobs, atol=1e-5,
                          rtol=0)
    for name in ("tp2_on", "tp2_sampled"):
        assert torch.equal(c[name].response_ids, c1[name].response_ids), name
    assert torch.equal(c["tp1_sampled"].response_ids, c["tp2_sampled"].response_ids)
    assert torch.equal(c["tp1_sampled"].response_mask, c["tp2_sampled"].response_mask)
