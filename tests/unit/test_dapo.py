"""DAPO's group filter, overlong penalty and the dynamic-sampling stage (single process)."""

import pytest
import torch

from hybridflow.algo import informative_groups, overlong_penalty
from hybridflow.data.batch import RolloutBatch
from hybridflow.rollout.dynamic_sampling import fill_informative


def test_informative_groups_by_hand():
    # ids 5: all 0; 9: all 1; 2: mixed; 7: alone; 4: mixed, rows not adjacent; 3: equal non-binary
    ids = torch.tensor([5, 5, 5, 9, 9, 2, 2, 7, 4, 3, 4, 3])
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.3, 0.25, 0.3])
    expected = [False] * 5 + [True, True] + [False] + [True, False, True, False]
    assert informative_groups(scores, ids).tolist() == expected


def test_informative_groups_shapes():
    with pytest.raises(ValueError, match=r"\(B,\)"):
        informative_groups(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    assert informative_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)).tolist() == []


def test_overlong_penalty_by_hand():
    # max 10, buffer 4: free up to 6, then -1/4 per token, -1 at 10 (times penalty_factor 0.5).
    lengths = torch.tensor([3, 6, 7, 8, 10])
    got = overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=10, buffer_len=0, penalty_factor=1.0)


# ---------------------------------------------------------------- the stage
N = 2  # samples per prompt


def make_round(tag: int, group_scores: list[list[float]], width: int = 3) -> RolloutBatch:
    """One round's batch: group g's rows have response ids tag*100 + g*10 + sample; responses of
    group g are g + 1 tokens long (so rounds' widths differ); scores as given."""
    rows = len(group_scores) * N
    resp = torch.tensor([[tag * 100 + g * 10 + k] * width for g in range(len(group_scores))
                         for k in range(N)])
    lengths = torch.tensor([min(g + 1, width) for g in range(len(group_scores)) for _ in range(N)])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return RolloutBatch(prompt_ids=torch.full((rows, 2), tag), prompt_mask=torch.ones(rows, 2).long(),
                        response_ids=resp * mask, response_mask=mask,
                        group_ids=torch.arange(len(group_scores)).repeat_interleave(N),
                        indices=torch.arange(rows) + tag * 1000,
                        scores=torch.tensor([s for g in group_scores for s in g]))


def scripted(rounds, num_groups: int = 3):
    calls = []

    def next_round(prompts):  # one batch a round: num_groups prompts
        assert prompts == num_groups
        calls.append(len(calls))
        tag = len(calls)
        return make_round(tag, rounds[tag - 1], width=2 + tag), {"reward/x/mean": float(tag)}

    return next_round, calls


def group_tags(batch):
    return [int(batch.response_ids[i, 0]) // 10 for i in range(0, batch.batch_size, N)]


def test_fills_with_mixed_groups_only():
    # round 1: all-0, mixed, all-1, mixed; round 2: mixed, all-0, all-0, mixed. Target 3 groups.
    nxt, calls = scripted([[[0, 0], [1, 0], [1, 1], [0, 1]], [[1, 0], [0, 0], [0, 0], [0, 1]]])
    batch, m = fill_informative(nxt, num_groups=3, group_size=N, max_rounds=5, pad_id=99)
    assert len(calls) == 2
    assert group_tags(batch) == [11, 13, 20]  # round 1 groups 1, 3; round 2 group 0
    assert informative_groups(batch.scores, batch.group_ids).all()
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.response_ids.shape[1] == 4 and batch.prompt_len == 2  # widths padded on cat
    # round 1's rows (width 3) gain a column: pad id in the ids, 0 in the mask
    assert batch.response_ids[:4, 3].tolist() == [99] * 4 and batch.response_mask[:4, 3].sum() == 0
    assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/cap_hit"] == 0
    assert m["dynamic_sampling/kept_fraction"] == 4 / 8
    assert m["dynamic_sampling/filler_groups"] == 0
    assert m["dynamic_sampling/score_mean"] == 6 / 16
    assert m["reward/x/mean"] == 1.5  # averaged over the rounds


def test_cap_hit_trains_on_what_there_is():
    all_equal = [[0, 0], [1, 1], [0, 0]]
    nxt, calls = scripted([all_equal, [[0, 0], [1, 0], [1, 1]], all_equal, all_equal])
    batch, m = fill_informative(nxt, num_groups=3, group_size=N, max_rounds=3)
    assert len(calls) == 3  # bounded by max_rounds
    assert group_tags(batch) == [21, 10, 11]  # the informative group first, then fillers
    assert m["dynamic_sampling/cap_hit"] == 1 and m["dynamic_sampling/filler_groups"] == 2
    assert m["dynamic_sampling/rounds"] == 3
    assert m["dynamic_sampling/kept_fraction"] == 1 / 9


def test_random_rounds_bounded_and_mixed():
    gen = torch.Generator().manual_seed(0)
    state = {"tag": 0}

    def next_round(prompts):
        assert prompts == 8  # one batch
        state["tag"] += 1
        scores = (torch.rand(8, N, generator=gen) < 0.3).float().tolist()
        return make_round(state["tag"], scores), {}

    batch, m = fill_informative(next_round, num_groups=8, group_size=N, max_rounds=6)
    assert 1 <= state["tag"] <= 6 and m["dynamic_sampling/rounds"] == state["tag"]
    keep = informative_groups(batch.scores, batch.group_ids)
    assert batch.batch_size == 8 * N
    assert int(keep.sum()) // N == 8 - m["dynamic_sampling/filler_groups"]


def test_round_batches_by_hand():
    from hybridflow.rollout.dynamic_sampling import round_batches

    assert round_batches(8, 8, None, 3) == 3  # nothing known yet: the cap
    assert round_batches(8, 8, 0.0, 3) == 3  # none kept so far: the cap
    assert round_batches(8, 8, 0.5, 3) == 2  # 8 / (0.5 x 8)
    assert round_batches(8, 8, 0.4, 3) == 3  # 2.5 -> 3
    assert round_batches(8, 8, 0.1, 3) == 3  # capped
    assert round_batches(2, 8, 0.5, 3) == 1  # 0.5 -> 1
    assert round_batches(8, 8, 1.0, 3) == 1


def test_batches_per_round_fixed_and_adaptive():
    """Fixed: every round draws batches_per_round batches. Adaptive: the first round from the
    caller's estimate, later ones from this step's kept fraction; `batches` counts them all."""
    def rounds_of(kept_per_batch, **kw):
        asked = []

        def next_round(prompts):  # batches of 4 groups
            assert prompts % 4 == 0
            k = prompts // 4
            asked.append(k)
            # per batch of 4 groups: the first `kept` informative ([0, 1]), the rest all-zero
            scores = [[0.0, 1.0] if g < kept_per_batch[len(asked) - 1] else [0.0, 0.0]
                      for _ in range(k) for g in range(4)]
            return make_round(len(asked), scores), {}

        batch, m = fill_informative(next_round, num_groups=4, group_size=N, max_rounds=4, **kw)
        assert informative_groups(batch.scores, batch.group_ids).all()  # target reached
        assert m["dynamic_sampling/batches"] == sum(asked) and m["dynamic_sampling/rounds"] == len(asked)
        return asked, m

    # fixed 2 per round, 1 informative group per batch: 2 found per round, 2 rounds
    assert rounds_of([1, 1, 1], batches_per_round=2)[0] == [2, 2]
    # adaptive, estimate 0.5: 4 missing / (0.5 x 4) = 2 batches, each with 2 kept: one round
    asked, m = rounds_of([2, 2], batches_per_round=3, adaptive=True, kept_estimate=0.5)
    assert asked == [2] and m["dynamic_sampling/kept_fraction"] == 0.5
    # adaptive without an estimate: the cap (3) first; then 1 missing at 1/4 kept: 1 batch
    asked, _ = rounds_of([1, 1], batches_per_round=3, adaptive=True)
    assert asked == [3, 1]
    # adaptive, estimate too optimistic (1.0 -> 1 batch): then this step's 1/4 -> 3 missing -> 3
    asked, _ = rounds_of([1, 1], batches_per_round=3, adaptive=True, kept_estimate=1.0)
    assert asked == [1, 3]
    with pytest.raises(ValueError, match="batches_per_round=0"):
        fill_informative(lambda k: None, num_groups=1, group_size=N, max_rounds=1, batches_per_round=0)


def test_round_prompts_by_hand():
    """The fewest groups n with n f - z sqrt(n f (1 - f)) >= missing, over the DP ranks, within
    1 .. cap batches; the cap when nothing is known."""
    from statistics import NormalDist

    from hybridflow.rollout.dynamic_sampling import round_prompts

    kw = dict(num_groups=64, dp=1, cap=3)
    assert round_prompts(64, kept_fraction=None, confidence=0.9, **kw) == 192
    assert round_prompts(64, kept_fraction=0.0, confidence=0.9, **kw) == 192
    n = round_prompts(64, kept_fraction=0.53, confidence=0.9, **kw)
    assert n == 135  # 2.1 batches, where whole batches take 2 (mean 67.8 found, often short)
    z, f = NormalDist().inv_cdf(0.9), 0.53
    for m in (n - 1, n):  # n is the first that holds
        holds = m * f - z * (m * f * (1 - f)) ** 0.5 >= 64
        assert holds == (m == n)
    # the probability it holds: P(Binomial(135, 0.53) >= 64) ~ 0.9 (exactly, by the pmf)
    from math import comb
    p = sum(comb(n, k) * f ** k * (1 - f) ** (n - k) for k in range(64, n + 1))
    assert 0.88 < p < 0.95
    assert round_prompts(64, kept_fraction=0.53, confidence=0.5, **kw) == 121  # 64 / 0.53
    assert round_prompts(64, kept_fraction=0.53, confidence=0.9, num_groups=32, dp=2,
                         cap=3) == 68  # 135 over 2 ranks, rounded up
    assert round_prompts(64, kept_fraction=0.1, confidence=0.9, **kw) == 192  # capped
    assert round_prompts(1, kept_fraction=1.0, confidence=0.99, **kw) == 1
    assert round_prompts(64, kept_fraction=1.0, confidence=0.9, **kw) == 64  # no variance


def test_confidence_sizes_rounds_in_prompts():
    """round_confidence: each round asks for prompts, not whole batches; `batches` counts
    prompts / num_groups; the target is reached with informative groups only."""
    asked = []

    def next_round(prompts):  # every second group informative
        asked.append(prompts)
        scores = [[0.0, 1.0] if g % 2 == 0 else [0.0, 0.0] for g in range(prompts)]
        return make_round(len(asked), scores), {}

    batch, m = fill_informative(next_round, num_groups=8, group_size=N, max_rounds=4,
                                batches_per_round=3, adaptive=True, kept_estimate=0.5,
                                confidence=0.9)
    assert asked[0] not in (8, 16, 24) and 16 < asked[0] < 24  # 2-3 batches, in prompts
    assert len(asked) == 1 and informative_groups(batch.scores, batch.group_ids).all()
    assert m["dynamic_sampling/batches"] == asked[0] / 8 and batch.batch_size == 8 * N


def test_round_confidence_checks():
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    base = ["experiment=demo", "algo=dapo", "reward.fn=math_exact", "reward.overlong_buffer.len=2"]
    for bad in ("1.0", "0.2", "true"):
        with pytest.raises(ValueError, match="round_confidence"):
            validate(load_config([*base, f"algo.dynamic_sampling.round_confidence={bad}"]),
                     world_size=1)
    with pytest.raises(ValueError, match="adaptive=true"):
        validate(load_config([*base, "algo.dynamic_sampling.round_confidence=0.9",
                              "algo.dynamic_sampling.adaptive=false"]), world_size=1)
    validate(load_config([*base, "algo.dynamic_sampling.round_confidence=0.9"]), world_size=1)


def test_chunking_warning_names_the_keys():
    from hybridflow.rollout.dynamic_sampling import chunking_warning

    kw = dict(local_prompts=64, n=8, gen_replicas=1)
    assert chunking_warning(batches_per_round=1, max_batch_size=512, **kw) is None  # 512 rows
    assert chunking_warning(batches_per_round=3, max_batch_size=1536, **kw) is None
    assert chunking_warning(batches_per_round=3, max_batch_size=768, local_prompts=64, n=8,
                            gen_replicas=2) is None  # two gen replicas split the round
    msg = chunking_warning(batches_per_round=3, max_batch_size=512, **kw)
    assert "up to 1536 rows" in msg and "rollout.max_batch_size=512" in msg
    assert msg.endswith("set rollout.max_batch_size=1536 where memory allows")
