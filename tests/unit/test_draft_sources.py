"""benchmarks/draft_sources.py: the offline count of accepted n-gram drafts, own context against
a group's sibling responses."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import draft_sources  # noqa: E402

KW = dict(k=4, ngram_max=3, ngram_min=1, tail_from=0, tail_rows_over=0)


def test_identical_siblings_draft_what_follows_and_own_context_cannot():
    """Rows of distinct tokens: the row's own context never repeats, so own drafts nothing; a
    sibling with the same response drafts the true continuation at every position after the
    first (where the last token is already a key), capped at the tokens left in the row."""
    row = list(range(100, 120))
    table = draft_sources.analyse({"groups": [{"prompt_ids": [1, 2, 3], "responses": [row, row]}]},
                                  **KW)["all"]
    assert table["own"]["mean_accepted"] == 0 and table["own"]["coverage"] == 0
    full = table["longest_full"]
    # each row at position p (emitted row[:p]): the last token row[p-1] is found in the sibling,
    # which continues with row[p:], so all min(4, 20 - p - 1) drafts are kept for p >= 1
    kept = sum(min(4, 20 - p - 1) for p in range(1, 20))
    assert full["row_steps"] == 40 and full["mean_accepted"] == kept * 2 / 40
    # sync: the sibling is visible only up to position p, so its match continues with row[p] at
    # most up to its visible end: it drafts nothing new at the row's own frontier
    assert table["longest_sync"]["mean_accepted"] == 0


def test_a_loop_is_drafted_from_own_context_periodically():
    """A response that repeats a 3-token cycle: today's own drafter continues the loop, and the
    longest-match drafter keeps own context first, so both accept the same."""
    row = [7, 8, 9] * 10
    t = draft_sources.analyse({"groups": [{"prompt_ids": [1], "responses": [row]}]}, **KW)["all"]
    assert t["own"]["mean_accepted"] > 2.5
    assert t["longest_full"] == t["own"] and t["fallback_full"] == t["own"]
