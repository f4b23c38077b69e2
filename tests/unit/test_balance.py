"""hybridflow.parallel.balance.partition: equal row counts, near-equal tokens, deterministic."""

import random

import pytest

from hybridflow.parallel.balance import partition


def test_equal_rows_and_bounded_imbalance():
    rng = random.Random(0)
    for parts in (2, 3, 4, 8):
        for _ in range(20):
            n = parts * rng.randint(1, 40)
            tokens = [rng.randint(1, 1200) for _ in range(n)]
            dealt = partition(tokens, parts)
            assert sorted(i for rows in dealt for i in rows) == list(range(n))
            assert {len(rows) for rows in dealt} == {n // parts}
            loads = [sum(tokens[i] for i in rows) for rows in dealt]
            assert max(loads) - sum(tokens) / parts <= max(tokens)
            assert dealt == partition(list(tokens), parts)  # the same on every rank


def test_skewed_ranks_are_evened_out():
    """Rank 0 generated only long responses, rank 1 only short ones (the case it is for)."""
    tokens = [1000] * 8 + [100] * 8
    dealt = partition(tokens, 2)
    assert [sum(tokens[i] for i in rows) for rows in dealt] == [4400, 4400]


def test_rows_must_deal_evenly():
    with pytest.raises(ValueError, match="7 rows cannot be dealt to 2"):
        partition([1] * 7, 2)
