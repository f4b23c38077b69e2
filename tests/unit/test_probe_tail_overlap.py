"""benchmarks/probe_tail_overlap.py's arithmetic: what an overlap of a pass with decoding hides."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from probe_tail_overlap import overlap_value  # noqa: E402


def test_overlap_value_hides_the_pass_net_of_the_decode_slowdown():
    # decoding unslowed while the pass runs at half speed: all of its time is hidden, and one
    # second of it takes 1 s / (0.5 x 1 ms) = 2,000 steps
    v = overlap_value(1.0, 1.0, 0.5)
    assert v["hidden_share"] == 1.0 and v["steps_per_pass_s"] == pytest.approx(2000.0)
    # a step of 2 ms instead of 1 that does 1.6 ms of the pass: 1 ms lost per 1.6 ms hidden
    assert overlap_value(1.0, 2.0, 0.8)["hidden_share"] == pytest.approx(1 - 1 / 1.6)
    # decoding slowed by more than the pass advances: the overlap loses
    assert overlap_value(1.0, 10.0, 0.5)["hidden_share"] < 0
