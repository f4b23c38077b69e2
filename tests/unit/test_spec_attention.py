"""kernels/spec_attention.py (the speculative tail's attention over S new tokens per row) on CPU,
through Triton's interpreter (TRITON_INTERPRET=1, in a fresh process:
tests/unit/spec_attention_check.py): the kernel equals its PyTorch twin with 1, 2 and 3 splits
(tokens past a row's n_valid and a finished row neither written nor marked, left-padded columns
and key_valid holes not read), and the generator's tail on the decode kernels
(speculative.verify_fused) emits the PyTorch tail's tokens, greedy (= plain decoding, also with
emulated graph buckets, compaction and a KV window, and on a q/k-norm model) and sampled; the
tail's bookkeeping as one kernel (next_token.advance_tail) equals its twin on random tail states
and, in the sampled and recipe cases, emits the same tokens; with unfiltered sampling the
acceptance before it (next_token.accept_advance_tail) equals `accept` + the twin on the same
draws.
The GPU's bf16 and CUDA graphs: tests/gpu/test_speculative_gpu.py."""

import pytest

from tests.unit.triton_interp import run_check


@pytest.fixture(scope="module")
def checked():
    return run_check("spec_attention_check.py")


def test_kernel_equals_its_twin(checked):
    cases = checked["kernel"]
    assert [c["splits"] for c in cases] == [1, 2, 3]
    for c in cases:
        assert c["attn_err"] < 1e-5 and c["cache_err"] == 0.0, c
        assert c["only_written"] and c["marks_equal"] and c["marks_are_written"], c


def test_advance_tail_kernel_equals_its_twin(checked):
    cases = checked["advance"]
    assert [(c["rows"], c["S"]) for c in cases] == [(6, 5), (5, 9), (3, 2)]
    for c in cases:
        assert c["differ"] == [], c
    # the cases reach the stop cut and the unmarking of rejected drafts' columns
    assert sum(c["stopped"] for c in cases) > 0 and sum(c["unmarked"] for c in cases) > 0


def test_fused_acceptance_equals_the_torch_acceptance(checked):
    cases = checked["race"]
    assert [(c["rows"], c["S"], c["V"]) for c in cases] == [(5, 4, 300), (4, 6, 1000), (3, 2, 200),
                                                             (6, 3, 300)]
    for c in cases:
        assert c["differ"] == [] and c["logprob_err"] < 1e-5, c
    # kept drafts, rejected ones (some that would have won the race), all kept, a stop
    for key in ("kept_drafts", "rejected", "rejected_would_win", "all_kept", "stopped"):
        assert sum(c[key] for c in cases) > 0, key


def test_fused_tail_emits_the_torch_tails_tokens(checked):
    cases = checked["generation"]
    for case in cases.values():
        assert case["fused_steps"] > 0 and case["fused_equals_torch_tail"], case
        assert case["logprob_err"] < 1e-4, case
    # graphed buckets, compaction and a window; Qwen3's q/k norms: greedy as plain
    assert set(cases) == {"greedy", "sampled", "recipe", "qk_norm"}
    for name in ("greedy", "recipe", "qk_norm"):
        g = cases[name]
        assert g["fused_equals_plain"] and g["fused_tokens"] > g["fused_steps"], (name, g)
