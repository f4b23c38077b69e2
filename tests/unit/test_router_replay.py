"""Routing replay (actor.router_replay=R3) on a tiny random Qwen3-MoE actor, fp32, one rank:
- the batch operations and sequence packing keep the recorded expert ids with their tokens;
- the generator records every routed token's experts (prompt and response, -1 where nothing was
  routed), the same with row compaction as without;
- with replay, the training forward (forward-only and the update's, with and without activation
  checkpointing) routes every recorded token to exactly the recorded experts (the routers' routing
  maps, bit for bit), packed micro-batches as unpacked ones;
- with the router perturbed between rollout and training (a stand-in for the bf16 / kernel router
  mismatch), the training log-probs are closer to the rollout's with replay than without, and the
  mismatch metric counts the changed decisions (0 without the perturbation).
"""

import dataclasses

import pytest
import torch

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig, RolloutConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.data.packing import pack_rows
from hybridflow.model_config import MoEConfig
from hybridflow.rollout.options import DecodeOptions

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, qk_layernorm=True, kv_channels=16,
                    moe=MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=16))
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12], [3]]
ROLLOUT = RolloutConfig(n=2, max_new_tokens=8, temperature=1.0, return_logprobs=True,
                        max_batch_size=8)


def _tagged_batch() -> RolloutBatch:
    """Rows whose expert ids are their token ids (k = 2: id, id + 100), -1 on padding."""
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    prompt_ids = torch.arange(1, 10).view(3, 3) * prompt_mask
    response_ids = (torch.arange(20, 32).view(3, 4)) * response_mask

    def tag(ids, mask):
        e = torch.stack([ids, ids + 100], -1)[:, :, None].expand(-1, -1, 2, -1)  # (B, T, L=2, k)
        return e.masked_fill(mask[..., None, None] == 0, -1).to(torch.int16)

    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, group_ids=torch.arange(3),
                        indices=torch.arange(3), prompt_experts=tag(prompt_ids, prompt_mask),
                        response_experts=tag(response_ids, response_mask))


def _check_tagged(b: RolloutBatch):
    ids, mask, experts = b.input_ids(), b.token_mask(), b.experts()
    assert experts.shape[:2] == ids.shape
    real = mask.bool()
    assert torch.equal(experts[..., 0, 0][real].long(), ids[real])
    assert torch.equal(experts[..., 1, 1][real].long(), ids[real] + 100)
    assert bool((experts[~real] == -1).all())


def test_batch_operations_keep_experts_with_their_tokens():
    b = _tagged_batch()
    _check_tagged(b)
    wide = b.widened(prompt_len=5, response_len=7, pad_id=0)
    assert wide.prompt_experts.shape[1] == 5 and wide.response_experts.shape[1] == 7
    for out in (wide, wide.trimmed(), b.padded_to(4), b.select(torch.tensor([2, 0])),
                RolloutBatch.cat([b.select(slice(0, 1)), wide.select(slice(1, 3))], pad_id=0)):
        _check_tagged(out)


def test_packed_experts_follow_their_tokens():
    b = _tagged_batch()
    packed = pack_rows(b, multiple=4)
    real = int(b.token_mask().sum())
    assert packed.experts.shape == (packed.input_ids.shape[1], 2, 2)
    assert torch.equal(packed.experts[:real, 0, 0].long(), packed.input_ids[0, :real])
    assert bool((packed.experts[real:] == -1).all())


@pytest.fixture(scope="module")
def setup(single_rank_ctx):
    from hybridflow.engine import Engine
    from hybridflow.parallel.reshard import generation_params
    from hybridflow.rollout import Generator

    def engine(checkpointing=False):
        eng = Engine(role="actor", model_cfg=MODEL, ctx=single_rank_ctx, precision="fp32",
                     parallel=ParallelConfig(activation_checkpointing=checkpointing),
                     optim=OptimConfig(lr=1e-3, clip_grad=0.0), router_replay="R3")
        g = torch.Generator().manual_seed(0)  # larger weights than Megatron's init: clear routing
        with torch.no_grad():
            for n, p in eng.module.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.1 * noise if "layernorm" in n else 0.3 * noise)
        eng.optimizer.reload_model_params()
        return eng

    eng = engine()
    params = generation_params(dict(eng.module.named_parameters()), single_rank_ctx, MODEL)
    gen = Generator(model_cfg=MODEL, params=params, tp_group=None, device="cpu",
                    dtype=torch.float32, true_vocab_size=MODEL.vocab_size)
    batch = gen.generate(PROMPTS, cfg=ROLLOUT, eos_id=-1, pad_id=0, seed=1, record_experts=True)
    return eng, engine, gen, batch


def test_generator_records_prompt_and_response_routing(setup):
    _, _, gen, batch = setup
    L, k, E = MODEL.num_layers, MODEL.moe.top_k, MODEL.moe.num_experts
    B, P, R = batch.batch_size, batch.prompt_len, batch.response_ids.shape[1]
    assert batch.prompt_experts.shape == (B, P, L, k) and batch.prompt_experts.dtype == torch.int16
    assert batch.response_experts.shape == (B, R, L, k)
    routed = batch.experts()[..., 0, 0] >= 0  # (B, P + R)
    fed = batch.token_mask().clone()
    fed[torch.arange(B), P + batch.response_mask.sum(1) - 1] = 0  # the last token is never fed
    assert torch.equal(routed.long(), fed)
    e = batch.experts()[routed.bool()]  # (n, L, k): distinct, in range
    assert bool((e >= 0).all() and (e < E).all()) and bool((e[..., 0] != e[..., 1]).all())
    # the n copies of a prompt share its prefill routing
    assert torch.equal(batch.prompt_experts[0::2], batch.prompt_experts[1::2])
    # greedy with rows stopping at different steps: compaction moves the records with the rows
    greedy = dataclasses.replace(ROLLOUT, temperature=0.0)
    first = gen.generate(PROMPTS, cfg=greedy, eos_id=-1, pad_id=0, seed=1)
    eos = int(first.response_ids[0, 2])  # a token some rows produce early, others later or never
    runs = [gen.generate(PROMPTS, cfg=greedy, eos_id=eos, pad_id=0, seed=1, record_experts=True,
                         options=DecodeOptions(kernels="torch", compact_finished_rows=compact,
                                               check_every=1))
            for compact in (False, True)]
    assert gen.stats["compactions"] > 0
    assert len(set(runs[0].response_mask.sum(1).tolist())) > 1
    for name in ("response_ids", "prompt_experts", "response_experts"):
        assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), name


def _routing_maps(model):
    """The routers' routing maps of the training passes run inside, per layer."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps, handles = {}, []
    for m in model.modules():
        if isinstance(m, TopKRouter):
            handles.append(m.register_forward_hook(
                lambda mod, a, out: maps.setdefault(mod.layer_number - 1, []).append(out[1])))
    return maps, handles


def _expected_maps(batch: RolloutBatch):
    """(tokens, E) bool per layer, the recorded experts in the routers' order, and which rows
    were recorded."""
    from hybridflow.models.moe import router_order

    ids = router_order(batch.experts()).long()  # (S * B, L, k)
    recorded = ids[:, 0, 0] >= 0
    E = MODEL.moe.num_experts
    return [torch.zeros(ids.shape[0], E, dtype=torch.bool).scatter_(1, ids[:, l].clamp(min=0), True)
            for l in range(ids.shape[1])], recorded


def _pg_loss_fn(batch: RolloutBatch):
    """(batch with old log-probs and advantages, a vanilla policy-gradient loss_fn for it)."""
    from hybridflow.algo import get_policy_loss

    pg = get_policy_loss("vanilla")
    batch = dataclasses.replace(batch, old_logprobs=batch.rollout_logprobs,
                                advantages=torch.linspace(-1, 1, batch.batch_size)[:, None]
                                * batch.response_mask)
    num_tokens = int(batch.response_mask.sum())

    def loss_fn(out, mb):
        loss, _ = pg(logprobs=out["logprobs"], old_logprobs=mb.old_logprobs,
                     advantages=mb.advantages, response_mask=mb.response_mask,
                     num_tokens=num_tokens)
        return loss, {"pg_loss": loss}

    return batch, loss_fn


def test_training_routes_by_the_record_bit_for_bit(setup):
    """The old-log-prob pass (the fixture's engine) and an update's forward (a fresh engine of the
    same weights: the step changes them), one micro-batch each."""
    eng, engine, _, batch = setup
    expected, recorded = _expected_maps(batch)
    trained = engine()
    train_batch, loss_fn = _pg_loss_fn(batch)
    maps, handles = _routing_maps(eng.module)
    train_maps, train_handles = _routing_maps(trained.module)
    try:
        eng.compute_logprobs(batch, micro_batch_size=batch.batch_size)
        trained.train_step(train_batch, loss_fn, micro_batch_size=batch.batch_size)
    finally:
        for h in handles + train_handles:
            h.remove()
    eng.replay_metrics("x")
    for layer in range(MODEL.num_layers):
        for m in maps[layer] + train_maps[layer]:
            assert torch.equal(m[recorded], expected[layer][recorded]), layer
            assert bool((m.sum(1) == MODEL.moe.top_k).all())  # unrecorded tokens: own top-k
        assert len(maps[layer]) == len(train_maps[layer]) == 1


def _perturbed(eng, scale: float):
    g = torch.Generator().manual_seed(5)
    saved = {}
    with torch.no_grad():
        for n, p in eng.module.named_parameters():
            if "router" in n:
                saved[n] = p.detach().clone()
                p.add_(scale * torch.randn(p.shape, generator=g))
    return saved


def _restore(eng, saved: dict):
    with torch.no_grad():
        for n, p in eng.module.named_parameters():
            if n in saved:
                p.copy_(saved[n])


def test_packed_and_token_budgets_equal_fixed_micro_batches_with_replay(setup):
    """Token budgets reorder and trim the rows, packing lays them end to end: the records follow;
    the router perturbed, so that replay changes decisions and a misplaced record shows."""
    eng, _, _, batch = setup
    saved = _perturbed(eng, 0.1)
    try:
        lp = eng.compute_logprobs(batch, micro_batch_size=batch.batch_size)
        ref = eng.replay_metrics("m")["m"]
        mask = batch.response_mask.bool()
        for pack in (False, True):
            out = eng.compute_logprobs(batch, micro_batch_size=batch.batch_size, max_tokens=40,
                                       pack=pack)
            torch.testing.assert_close(out[mask], lp[mask], atol=1e-5, rtol=1e-5)
            assert eng.replay_metrics("m")["m"] == pytest.approx(ref, abs=1e-9)
    finally:
        _restore(eng, saved)
    assert ref > 0


def test_replay_brings_training_logprobs_closer_to_the_rollout(setup):
    eng, _, _, batch = setup
    mask = batch.response_mask.bool()

    def error(replay):
        lp = eng.compute_logprobs(batch, micro_batch_size=4, temperature=ROLLOUT.temperature,
                                  replay=replay)
        return float((lp - batch.rollout_logprobs)[mask].abs().mean())

    same = error(True)
    assert eng.replay_metrics("m") == {"m": 0.0}  # the rollout's weights, fp32: same routing
    assert same < 1e-5
    saved = _perturbed(eng, 0.1)
    try:
        with_replay = error(True)
        mismatch = eng.replay_metrics("m")["m"]
        without = error(False)
        assert eng.replay_metrics("m") == {}  # nothing bound without replay
    finally:
        _restore(eng, saved)
    assert 0.05 < mismatch < 1.0
    assert with_replay < 0.7 * without, (with_replay, without)


def test_update_with_checkpointing_replays_in_the_recomputation(setup):
    """Activation checkpointing recomputes each layer in backward, after the micro-batch's targets
    were unbound: the recomputation must route as the forward did (same loss and gradient)."""
    _, engine, _, batch = setup
    batch, loss_fn = _pg_loss_fn(batch)

    results = []
    for checkpointing in (False, True):
        eng = engine(checkpointing)
        _perturbed(eng, 0.1)  # so that replay changes decisions
        m = eng.train_step(batch, loss_fn, micro_batch_size=4)
        results.append(m)
    for key in ("pg_loss", "grad_norm", "moe/router_mismatch_frac_update"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-6, abs=1e-7), key
    assert results[0]["moe/router_mismatch_frac_update"] > 0


MOE = ["experiment=demo", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.moe_ffn_hidden_size=32"]


@pytest.mark.parametrize("extra,match", [
    (["actor.router_replay=R3"], None),
    (["actor.router_replay=rollout"], r"actor.router_replay='rollout' is not one of"),
    (["actor.router_replay=R2"], r"actor.router_replay=R2 .* not implemented"),
    (["actor.router_replay=R3", "model.moe.num_experts=0"], r"actor.router_replay=R3 needs a "
                                                            r"mixture-of-experts model"),
    (["actor.router_replay=R3", "rollout.multi_turn.enable=true"],
     r"rollout.multi_turn.enable=true is not supported"),
    (["actor.router_replay=R3", "rollout.partial.enable=true"],
     r"rollout.partial.enable=true is not supported"),
])
def test_config_checks_name_the_key(extra, match):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate_router_replay

    cfg = load_config([*MOE, *extra])
    if match is None:
        validate_router_replay(cfg)
        return
    with pytest.raises(ValueError, match=match):
        validate_router_replay(cfg)
