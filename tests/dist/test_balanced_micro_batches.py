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
