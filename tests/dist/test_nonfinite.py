"""A non-finite gradient on one rank skips the optimizer step on every rank: weights, Adam state
and LR schedule stay as they were, and the next finite step updates normally (Engine.train_step,
hybridflow/nonfinite.py). Without the guard Megatron's clip sees a NaN norm, skips clipping
(`coeff < 1` is false) and Adam writes NaN into every weight."""

import torch

from hybridflow.algo.objectives import actor_objective
from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.parallel import groups
import pytest

from tests.dist.launcher import run_each
from tests.dist.test_loss_agg import _global_batch

MODEL = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)


def _snapshot(eng) -> dict:
    return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def _worker(tp: int):
    import torch.distributed as dist

    from hybridflow.engine import Engine

    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=3)
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx,
                 parallel=ParallelConfig(tensor_parallel_size=tp, use_distributed_optimizer=False),
                 precision="fp32", optim=OptimConfig(lr=1e-2, clip_grad=1.0), total_updates=10)
    rank = dist.get_rank()
    batch = _global_batch()
    if ctx.dp_size > 1:
        half = batch.batch_size // 2
        batch = batch.select(slice(ctx.train.dp * half, (ctx.train.dp + 1) * half))
    good = actor_objective(AlgoConfig(), num_tokens=int(batch.response_mask.sum()), num_seqs=8)

    def nan_on_rank1(out, mb):
        loss, metrics = good(out, mb)
        return (loss * float("nan") if rank == 1 else loss), metrics

    before, lr_before = _snapshot(eng), eng.optimizer.param_groups[0]["lr"]
    skipped = eng.train_step(batch, nan_on_rank1, micro_batch_size=4)
    after_skip = _snapshot(eng)
    inner = getattr(eng.optimizer, "chained_optimizers", [eng.optimizer])
    state_after_skip = sum(len(o.optimizer.state) for o in inner)
    taken = eng.train_step(batch, good, micro_batch_size=4)
    after_step = _snapshot(eng)
    return {"skipped": skipped, "taken": taken,
            "unchanged": all(torch.equal(before[n], after_skip[n]) for n in before),
            "moved": any(not torch.equal(after_skip[n], after_step[n]) for n in before),
            "finite": all(torch.isfinite(p).all() for p in after_step.values()),
            "adam_state_after_skip": state_after_skip, "lr": (lr_before,
                                                              taken["lr"])}


def _check(results):
    for r in results:
        assert r["skipped"]["update_skipped"] == 1.0 and r["unchanged"], r
        assert r["adam_state_after_skip"] == 0  # Adam never stepped: no moments yet
        assert r["taken"]["update_skipped"] == 0.0 and r["moved"] and r["finite"], r
        assert torch.isfinite(torch.tensor(r["taken"]["grad_norm"]))
        assert r["lr"][0] == r["lr"][1]  # the schedule did not advance on the skipped step


@pytest.fixture(scope="module")
def layouts():
    """DP=2 and TP=2, one launch of 2 ranks (both tests share it)."""
    return run_each(2, {"dp2": (_worker, 1), "tp2": (_worker, 2)})


def test_nan_on_one_dp_rank_skips_the_step_everywhere(layouts):
    _check([rank["dp2"] for rank in layouts])


def test_nan_on_one_tp_rank_skips_the_step_everywhere(layouts):
    """TP=2: the NaN loss is rank 1's only; the shards differ, so only the all-reduced flag can
    make rank 0 skip too."""
    _check([rank["tp2"] for rank in layouts])
