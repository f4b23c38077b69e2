"""Routing replay (actor.router_replay=R3) across layouts, 2 gloo ranks against 1 (fp32): a tiny
Qwen3-MoE actor given the same weights in every layout replays the same recorded experts, so its
log-probs, the replay mismatch share and one update's loss and grad norm equal the 1-rank run's at
EP=2 (DP=2: each rank its rows, half the experts), TP=2 + SP (each rank routes half the sequence) and
PP=2 (each stage binds its own layers). The recorded experts are random (distinct per token, -1 on
padding and on each response's last token), so nearly every decision is replayed against the
router's own choice: a row, column or layer bound to the wrong token changes the results.
A GRPO step of the real trainer with replay runs at EP=2 and logs the mismatch metrics."""

import pytest
import torch

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.model_config import MoEConfig
from tests.dist.launcher import run_ranks

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, qk_layernorm=True, kv_channels=16,
                    moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16))


def _batch() -> RolloutBatch:
    from tests.dist.test_parallel_parity import _global_batch

    b = _global_batch()
    g = torch.Generator().manual_seed(1)
    B, S, L, k = b.batch_size, b.input_ids().shape[1], MODEL.num_layers, MODEL.moe.top_k
    ids = torch.rand(B, S, L, MODEL.moe.num_experts, generator=g).argsort(-1)[..., :k]
    fed = b.token_mask().clone()
    fed[torch.arange(B), b.prompt_len + b.response_mask.sum(1) - 1] = 0
    ids = ids.masked_fill(fed[..., None, None] == 0, -1).to(torch.int16)
    return RolloutBatch(**{**b.__dict__, "prompt_experts": ids[:, :b.prompt_len],
                           "response_experts": ids[:, b.prompt_len:]})


def _fill(eng, ctx):
    from hybridflow.parallel import param_rules as pr
    from tests.dist.parity_util import _seed_of, full_shape

    coords = ctx.expert_coords
    kw = dict(ep_rank=coords["ep_rank"], num_experts=MODEL.moe.num_experts,
              ep_size=coords["ep_size"])
    with torch.no_grad():
        for name, p in eng.module.named_parameters():
            g_name = pr.global_expert_name(
                pr.global_name(name, pp_rank=ctx.train.pp, num_layers=MODEL.num_layers,
                               pp_size=ctx.pp_size), **kw)
            g = torch.Generator().manual_seed(_seed_of(g_name))
            full = torch.randn(full_shape(name, p.shape, ctx.tp_size), generator=g) * 0.2
            full = 1.0 + full if "layernorm" in name else full
            p.copy_(pr.shard_tensor(name, full, tp_rank=ctx.train.tp, tp_size=ctx.tp_size))
    eng.optimizer.reload_model_params()


def _worker(tp: int, pp: int, ep: int):
    import torch.distributed as dist

    from hybridflow.algo import get_policy_loss
    from hybridflow.engine import Engine
    from hybridflow.parallel import groups

    ctx = groups.init_model_parallel(tp=tp, pp=pp, seed=3, ep=ep)
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, precision="fp32",
                 parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                         sequence_parallel=tp > 1, expert_parallel_size=ep,
                                         use_distributed_optimizer=False),
                 optim=OptimConfig(lr=1e-3, clip_grad=0.0), router_replay="R3")
    _fill(eng, ctx)
    batch = _batch()
    num_tokens = int(batch.response_mask.sum())
    dp, rank = ctx.dp_size, ctx.train.dp
    local = batch.select(slice(rank * batch.batch_size // dp, (rank + 1) * batch.batch_size // dp))
    out = {}
    for replay in (True, False):
        lp = eng.compute_logprobs(local, micro_batch_size=2, replay=replay)
        if dp > 1:
            parts = [torch.empty_like(lp) for _ in range(dp)]
            dist.all_gather(parts, lp, group=ctx.dp_group)
            lp = torch.cat(parts)
        out[f"logprobs_{replay}"] = lp
    out.update(eng.replay_metrics("mismatch"))
    pg = get_policy_loss("vanilla")

    def loss_fn(res, mb):
        loss, _ = pg(logprobs=res["logprobs"], old_logprobs=mb.old_logprobs,
                     advantages=mb.advantages, response_mask=mb.response_mask,
                     num_tokens=num_tokens)
        return loss, {"pg_loss": loss}

    m = eng.train_step(local, loss_fn, micro_batch_size=2)
    out.update({k: v for k, v in m.items() if not isinstance(v, torch.Tensor)})
    return out


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_worker, 1, 1, 1, 1)[0]


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (2, 1, 1), (1, 2, 1)], ids=["ep2", "tp2", "pp2"])
def test_layouts_replay_alike(reference, tp, pp, ep):
    ref = reference
    mask = _batch().response_mask.bool()
    # replay changes the result (the random records disagree with the router) ...
    assert ref["mismatch"] > 0.5
    assert (ref["logprobs_True"] - ref["logprobs_False"])[mask].abs().max() > 1e-2
    for out in run_ranks(_worker, 2, tp, pp, ep):
        for replay in (True, False):  # ... and every layout replays it alike
            torch.testing.assert_close(out[f"logprobs_{replay}"][mask],
                                       ref[f"logprobs_{replay}"][mask], atol=2e-5, rtol=1e-5)
        for key in ("mismatch", "moe/router_mismatch_frac_update", "pg_loss", "grad_norm"):
            assert out[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


GRPO = ["experiment=demo", "algo=grpo", "trainer.sft_warmup_steps=0", "trainer.total_steps=1",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=6",
        "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=2",
        "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.moe_ffn_hidden_size=32",
        "parallel.expert_parallel_size=2", "actor.router_replay=R3",
        "algo.skip_redundant_old_log_prob=false"]


def _grpo(out_dir):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    cfg = load_config([*GRPO, f"trainer.output_dir={out_dir}"])
    validate(cfg, world_size=torch.distributed.get_world_size())
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed, ep=2)
    trainer = Trainer(cfg, ctx)
    batches = []
    compute = trainer.actor.compute_logprobs

    def spy(batch, **kw):  # the old-log-prob pass sees the rollout's routing
        batches.append(batch)
        return compute(batch, **kw)

    trainer.actor.compute_logprobs = spy
    history = trainer.train()
    return history, [(b.prompt_experts is not None, tuple(b.response_experts.shape))
                     for b in batches], cfg.model.num_layers


def test_grpo_step_with_replay(tmp_path):
    for history, seen, num_layers in run_ranks(_grpo, 2, str(tmp_path)):
        (metrics,) = history
        assert seen and all(has for has, _ in seen)
        assert seen[0][1][2:] == (num_layers, 2)
        # the rollout's weights, its routing: only near-ties of bf16 / fp32 rounding may differ
        assert 0.0 <= metrics["moe/router_mismatch_frac"] < 0.05
        assert 0.0 <= metrics["moe/router_mismatch_frac_update"] < 0.05
        assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
