"""Dynamic sampling pools informative groups over DP ranks (2 gloo ranks, no model): every rank runs
the same number of rounds, the pool is rank-major then round-major, each rank takes its slice."""

from hybridflow.parallel import groups
from hybridflow.rollout.dynamic_sampling import fill_informative
from tests.dist.launcher import run_ranks
from tests.unit.test_dapo import N, group_tags, make_round

# rounds[rank][round] = scores of that round's 2 groups (2 samples each)
ROUNDS = [
    [[[0, 0], [1, 0]], [[1, 1], [0, 0]], [[0, 1], [0, 0]]],  # rank 0: kept 11 (r1 g1), 30 (r3 g0)
    [[[1, 1], [1, 1]], [[0, 1], [1, 0]], [[0, 0], [0, 0]]],  # rank 1: kept 120, 121 (r2 g0, g1)
]


def _fill(ctx, max_rounds: int):
    rank = ctx.train.dp
    calls = []

    def next_round():
        calls.append(1)
        tag = 10 * rank + len(calls)
        return make_round(tag, ROUNDS[rank][len(calls) - 1]), {"reward/x/mean": float(len(calls))}

    batch, m = fill_informative(next_round, num_groups=2, group_size=N, max_rounds=max_rounds,
                                dp_group=ctx.dp_group, pad_id=0)
    return {"tags": group_tags(batch), "group_ids": batch.group_ids.tolist(), "metrics": m,
            "calls": len(calls)}


def _worker():
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)
    return {max_rounds: _fill(ctx, max_rounds) for max_rounds in (5, 2)}


def test_pooled_over_dp_and_cap_hit():
    results = run_ranks(_worker, 2)
    r0, r1 = results[0][5], results[1][5]
    assert r0["calls"] == r1["calls"] == 3  # 1 + 0, then 3, then 4 >= 2 x 2 informative groups
    assert r0["tags"] == [11, 30] and r1["tags"] == [120, 121]
    assert r0["group_ids"] == [0, 0, 1, 1] and r1["group_ids"] == [2, 2, 3, 3]
    assert r0["metrics"] == r1["metrics"]
    assert r0["metrics"]["dynamic_sampling/kept_fraction"] == 4 / 12
    assert r0["metrics"]["dynamic_sampling/cap_hit"] == 0
    # cap hit at 2 rounds:
    r0, r1 = results[0][2], results[1][2]
    assert r0["calls"] == r1["calls"] == 2
    # informative 11, 120, 121, then the first spare group in rank-major order: rank 0's r1 g0
    assert r0["tags"] == [11, 120] and r1["tags"] == [121, 10]
    assert r0["metrics"]["dynamic_sampling/cap_hit"] == 1
    assert r0["metrics"]["dynamic_sampling/filler_groups"] == 1
