"""TP=2 (+SP), PP=2 and DP=2 (distributed optimizer) give the loss and gradients of a 1-rank run.

Every layout holds the same weights (each rank loads its shard of one deterministic full state dict),
sees the same global batch (split over DP) and runs one PPO policy-loss step through the Engine
(Megatron forward_backward_func, DDP, Megatron optimizer). Compared to the 1-rank reference, fp32:
the loss, every full gradient (TP/PP shards merged), the optimizer's grad norm, and the weights
after one Adam step.
"""

import dataclasses

import pytest
import torch
from megatron.core import parallel_state as ps

from hybridflow.algo import get_policy_loss, value_loss
from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks
from tests.dist.parity_util import fill_deterministic, gather_full

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, add_qkv_bias=True)
# Qwen3-shaped: q/k norms (replicated over TP, their grads summed over it), head_dim 16 != 32 / 4
QWEN3 = dataclasses.replace(MODEL, add_qkv_bias=False, qk_layernorm=True, kv_channels=16)


def _global_batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    b, p, r = 8, 4, 6
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    prompt_mask[5, :1] = 0
    lengths = torch.tensor([6, 3, 5, 1, 6, 2, 4, 6])
    response_mask = (torch.arange(r)[None] < lengths[:, None]).long()
    return RolloutBatch(
        prompt_ids=torch.randint(0, 50, (b, p), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(0, 50, (b, r), generator=g) * response_mask,
        response_mask=response_mask, group_ids=torch.arange(b) // 2, indices=torch.arange(b),
        old_logprobs=-3.9 + 0.1 * torch.randn(b, r, generator=g),
        advantages=torch.randn(b, r, generator=g) * response_mask)


def _worker(tp: int, pp: int, dp_expected: int, dist_opt: bool, sp: bool = True,
            role: str = "actor", model: ModelConfig = MODEL):
    from hybridflow.engine import Engine

    ctx = groups.init_model_parallel(tp=tp, pp=pp, seed=3)
    assert ps.get_data_parallel_world_size() == dp_expected
    par = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                         sequence_parallel=sp and tp > 1, use_distributed_optimizer=dist_opt)
    eng = Engine(role=role, model_cfg=model, ctx=ctx, parallel=par, precision="fp32",
                 optim=OptimConfig(lr=1e-3, clip_grad=0.0), total_updates=1)
    fill_deterministic(eng.module, num_layers=model.num_layers)
    if dist_opt:  # the distributed optimizer keeps its own fp32 copy: refresh it from the model
        eng.optimizer.reload_model_params()
    batch = _global_batch()
    num_tokens = int(batch.response_mask.sum())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = batch.select(slice(dp_rank * batch.batch_size // dp,
                               (dp_rank + 1) * batch.batch_size // dp))
    pg = get_policy_loss("vanilla")

    def loss_fn(out, mb):
        if role == "critic":
            loss, m = value_loss(values=out["values"], old_values=mb.old_logprobs * 0.1,
                                 returns=mb.advantages, response_mask=mb.response_mask,
                                 num_tokens=num_tokens)
            return loss, {"pg_loss": loss}
        loss, m = pg(logprobs=out["logprobs"], old_logprobs=mb.old_logprobs,
                     advantages=mb.advantages, response_mask=mb.response_mask,
                     num_tokens=num_tokens)
        return loss, {"pg_loss": loss, **m}

    metrics = eng.train_step(local, loss_fn, micro_batch_size=2)
    grads = {}
    if not dist_opt:  # DDP all-reduced full grads live in main_grad (dist-opt keeps only a shard)
        named = {n: p.main_grad for n, p in eng.module.named_parameters()}
        grads = gather_full(named, num_layers=model.num_layers)
    weights = gather_full(dict(eng.module.named_parameters()),
                          num_layers=model.num_layers)
    return {"loss": metrics["pg_loss"], "grad_norm": metrics["grad_norm"], "grads": grads,
            "weights": weights}


def _cases(cases: dict) -> dict:
    """Each case's `_worker` in this one launch (every case re-builds the parallel groups and
    re-seeds; rank start-up is most of a case's cost)."""
    return {name: _worker(*args) for name, args in cases.items()}


# the 1-rank references and the default tier's 2-rank layouts, one launch each (their tests share them)
REFERENCES = {"actor": (1, 1, 1, False, False), "critic": (1, 1, 1, False, False, "critic"),
              "qwen3": (1, 1, 1, False, False, "actor", QWEN3)}
TWO_RANKS = {"tp2_sp": (2, 1, 1, False, True), "pp2": (1, 2, 1, False, False),
             "dp2_distopt": (1, 1, 2, True, False),
             "critic_tp2_sp": (2, 1, 1, False, True, "critic"),
             "qwen3_tp2": (2, 1, 1, False, False, "actor", QWEN3)}


@pytest.fixture(scope="module")
def references():
    return run_ranks(_cases, 1, REFERENCES)[0]


@pytest.fixture(scope="module")
def two_ranks():
    """Per rank: {case: result} of TWO_RANKS."""
    return run_ranks(_cases, 2, TWO_RANKS)


def _layout_results(request, name: str, args: tuple) -> list:
    """Every rank's result of a layout: from the shared 2-rank launch, or (a slow-tier twin) its own."""
    if name in TWO_RANKS:
        assert TWO_RANKS[name] == args, name
        return [r[name] for r in request.getfixturevalue("two_ranks")]
    tp, pp, dp = args[:3]
    return run_ranks(_worker, tp * pp * dp, *args)


# tp2_sp, pp2 and dp2_distopt in the default tier; tp2 and dp2_ddp (their plainer twins) in the slow one
@pytest.mark.parametrize("tp,pp,dp,dist_opt,sp", [
    pytest.param(2, 1, 1, False, True, id="tp2_sp"),
    pytest.param(2, 1, 1, False, False, id="tp2", marks=pytest.mark.slow),
    pytest.param(1, 2, 1, False, False, id="pp2"),
    pytest.param(1, 1, 2, True, False, id="dp2_distopt"),
    pytest.param(1, 1, 2, False, False, id="dp2_ddp", marks=pytest.mark.slow)])
def test_matches_single_rank(request, references, tp, pp, dp, dist_opt, sp):
    layout = request.node.callspec.id
    results = _layout_results(request, layout, (tp, pp, dp, dist_opt, sp))
    ref = references["actor"]
    for res in results:
        assert abs(res["loss"] - ref["loss"]) < 1e-5, (res["loss"], ref["loss"])
        assert abs(res["grad_norm"] - ref["grad_norm"]) < 1e-5 * max(1.0, ref["grad_norm"])
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], atol=1e-5, rtol=1e-4, msg=name)
        assert set(res["weights"]) == set(ref["weights"])
        for name, w in res["weights"].items():
            torch.testing.assert_close(w, ref["weights"][name], atol=1e-5, rtol=1e-4, msg=name)
    assert ref["grad_norm"] > 0 and len(ref["grads"]) == len(ref["weights"]) > 0


def test_critic_tp2_sp_matches_single_rank(request, references):
    """The critic's replicated value head under sequence parallelism (its gather must not sum the
    already-identical grads over TP)."""
    ref = references["critic"]
    for res in _layout_results(request, "critic_tp2_sp", TWO_RANKS["critic_tp2_sp"]):
        assert abs(res["loss"] - ref["loss"]) < 1e-5
        assert abs(res["grad_norm"] - ref["grad_norm"]) < 1e-5 * max(1.0, ref["grad_norm"])
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], atol=1e-5, rtol=1e-4, msg=name)


# tp2 needs TransformerConfig.qk_layernorm for the sum; under SP the norms' sequence_parallel tag
# alone would sum them (the slow tier checks they are not summed twice)
@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["tp2", "tp2_sp"])
def test_qk_layernorm_tp2_matches_single_rank(request, references, sp):
    """Qwen3's q/k norms at TP=2: each rank's heads give part of the norm weights' gradient, which
    finalize_model_grads sums over TP (TransformerConfig.qk_layernorm), once also under SP."""
    ref = references["qwen3"]
    assert any("q_layernorm" in n for n in ref["grads"])
    for res in _layout_results(request, f"qwen3_{request.node.callspec.id}",
                               (2, 1, 1, False, sp, "actor", QWEN3)):
        assert abs(res["loss"] - ref["loss"]) < 1e-5
        assert abs(res["grad_norm"] - ref["grad_norm"]) < 1e-5 * max(1.0, ref["grad_norm"])
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], atol=1e-5, rtol=1e-4, msg=name)
        for name, w in res["weights"].items():
            torch.testing.assert_close(w, ref["weights"][name], atol=1e-5, rtol=1e-4, msg=name)
