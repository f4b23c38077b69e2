"""trainer.balance_batch re-deals the step's rows over DP by tokens and changes nothing else
(2 gloo ranks, real trainer, one mini-batch per step).

The generator's responses are cut to lengths that differ by rank (rank 0 keeps all 6 tokens, rank 1
keeps 1-3), so the ranks' token counts differ. Balanced, each rank trains on an equal share of
tokens; the one update per step sums the same rows' gradients over the same global normalisers, so
the weights after 3 steps equal the unbalanced run's up to fp32 summation order, and the
step's global metrics (scores, lengths, advantages) are the same. Measured: weights moved by 3e-3,
balanced vs not by 2.2e-6 (Adam divides each gradient by its own running RMS, so the summation-order
rounding of the smallest gradients shows at that size); a lost or doubled row moves the update by
the size of a row's share (~1e-3): the bound is 1e-5.
"""

import pytest
import torch

from tests.dist.launcher import run_ranks
from tests.dist.test_free_cache_engine import BASE, STEPS  # the same short GRPO run
RUNS = {"off": [], "on": ["trainer.balance_batch=true"]}


def _cut(generate, rank, pad_id):
    def wrapped(*args, **kw):
        batch = generate(*args, **kw)
        b, r = batch.response_ids.shape
        keep = torch.full((b,), r) if rank == 0 else 1 + torch.arange(b) % 3
        mask = (torch.arange(r)[None, :] < keep[:, None]).long() * batch.response_mask
        batch.response_mask = mask
        batch.response_ids = batch.response_ids.masked_fill(mask == 0, pad_id)
        return batch

    return wrapped


def _runs(out_dir):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    results = {}
    for name, extra in RUNS.items():
        cfg = load_config(["experiment=demo", *BASE, f"trainer.output_dir={out_dir}/{name}", *extra])
        validate(cfg, world_size=torch.distributed.get_world_size())
        ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
        trainer = Trainer(cfg, ctx)
        trainer.rollout.generate = _cut(trainer.rollout.generate, ctx.train.dp,
                                        trainer.tokenizer.pad_id)
        init = {k: p.detach().clone() for k, p in trainer.actor.module.named_parameters()}
        history = trainer.train()
        results[name] = {"history": history, "init": init,
                         "weights": {k: p.detach().clone()
                                     for k, p in trainer.actor.module.named_parameters()}}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("balance")))


def test_balanced_run_equals_unbalanced(runs):
    for rank in runs:
        off, on = rank["off"], rank["on"]
        for m_off, m_on in zip(off["history"], on["history"]):
            for k in ("critic/score/mean", "critic/advantages/mean", "response_length/mean",
                      "perf/total_num_tokens"):
                assert m_on[k] == pytest.approx(m_off[k], rel=1e-6), k
            for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
                assert m_on[k] == pytest.approx(m_off[k], rel=1e-4, abs=1e-6), k
            assert "timing_s/balance" in m_on and "global_seqlen/max" not in m_off
        moved = max(float((w - off["init"][n]).abs().max()) for n, w in off["weights"].items())
        diff = max(float((on["weights"][n] - w).abs().max()) for n, w in off["weights"].items())
        assert moved > 1e-3 and diff <= 1e-5, (moved, diff)


def test_tokens_evened_out(runs):
    for rank in runs:
        for m in rank["on"]["history"]:
            assert m["global_seqlen/minmax_diff"] > 0  # the cut made the ranks unequal
            assert m["global_seqlen/balanced_max"] < m["global_seqlen/max"]
            assert m["global_seqlen/balanced_min"] > m["global_seqlen/min"]
            assert m["global_seqlen/balanced_max"] - m["global_seqlen/mean"] <= 6 + 64
