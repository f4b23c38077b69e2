"""algo.balance_micro_batches through the real Engine: packed token-budget micro-batches dealt
evenly (data/microbatch.py) give the results of next-fit's, fp32: log-probs, entropies, critic
values, one actor update's metrics, every gradient and the weights after Adam. The ragged batch of
test_dynamic_bsz at its budget makes other micro-batches under the two (checked, so the test
cannot pass by running the same ones). Layouts: one rank, and TP=2 with sequence parallel (the
rows' tokens rounded up to the TP size in both)."""

import pytest

from hybridflow.config import ParallelConfig
from hybridflow.data.microbatch import token_budget_groups
from hybridflow.parallel import groups
from tests.dist import test_dynamic_bsz as dyn
from tests.dist.launcher import run_ranks


def _worker(tp: int, sp: bool):
    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=3)
    batch = dyn._batch()
    par = ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp,
                         use_distributed_optimizer=False)
    multiple = tp if sp else 1
    out = {"mask": batch.response_mask.bool()}
    for balanced in (False, True):
        out["groups", balanced] = token_budget_groups(
            batch.prompt_mask.sum(1), batch.response_mask.sum(1), max_tokens=dyn.BUDGET,
            multiple=multiple, packed=True, balanced=balanced)
        make = dyn.engine_factory(ctx, par, balanced_micro_batches=balanced)
        out[balanced] = dyn.engine_results(make, batch, max_tokens=dyn.BUDGET, pack=True,
                                           num_tokens=int(batch.response_mask.sum()),
                                           num_seqs=batch.batch_size)
    return out


@pytest.mark.parametrize("world,tp,sp", [(1, 1, False), (2, 2, True)], ids=["tp1", "tp2_sp"])
def test_balanced_micro_batches_match_next_fit(world, tp, sp):
    for res in run_ranks(_worker, world, tp, sp):
        assert res["groups", True] != res["groups", False]
        dyn.assert_same_results(res[True], res[False], res["mask"], atol=1e-6)


def _trainer_step(out_dir):
    """One demo training step with packed token budgets, next-fit and balanced: the step's
    perf/<stage>_micro_batches and _smallest_micro_batch_tokens metrics."""
    import torch.distributed as dist

    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.trainer import Trainer

    out = {}
    for balanced in (False, True):
        cfg = load_config([
            "experiment=demo", "algo=grpo", "algo.use_kl_loss=true", "trainer.total_steps=1",
            "trainer.sft_warmup_steps=0", "trainer.tensorboard=false",
            "trainer.progress_bar=false", f"trainer.output_dir={out_dir}/{balanced}",
            "algo.use_dynamic_bsz=true", "algo.pack_sequences=true",
            "algo.max_tokens_per_micro_batch_per_gpu=128",
            "algo.forward_max_tokens_per_micro_batch_per_gpu=128",
            f"algo.balance_micro_batches={str(balanced).lower()}"])
        validate(cfg, world_size=dist.get_world_size())
        ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
        (m,) = Trainer(cfg, ctx).train()
        out[balanced] = {k: v for k, v in m.items() if "micro_batch" in k}
    return out


def test_the_step_reports_its_passes_micro_batches(tmp_path):
    """Through the Trainer (config -> engines -> metrics): the ref and update passes report how
    many micro-batches ran and the smallest one's tokens. The ref pass (one pass over the step's
    rows) leaves next-fit a small last micro-batch; dealt evenly it is far larger."""
    (res,) = run_ranks(_trainer_step, 1, str(tmp_path))
    for stage in ("ref", "update_actor"):
        nf, bal = (res[b][f"perf/{stage}_micro_batches"] for b in (False, True))
        assert 1 < bal <= nf, (stage, res)
        for b in (False, True):
            assert 0 < res[b][f"perf/{stage}_smallest_micro_batch_tokens"] <= 128, (stage, res)
    small = [res[b]["perf/ref_smallest_micro_batch_tokens"] for b in (False, True)]
    assert small[0] < 64 < small[1], res
