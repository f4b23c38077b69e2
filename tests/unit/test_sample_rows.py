"""kernels/sample.sample_rows (rollout.kernel_options.fused_sampler): temperature sampling by the
inverse CDF and the drawn token's log-prob in two Triton passes over the logits, with a Philox
stream in a device tensor. The Triton kernels run through Triton's CPU interpreter in a fresh
process (tests/unit/sample_rows_check.py): log-probs equal log_softmax (bf16 and fp32 logits, one
row and several, a vocabulary of one and of three chunks), `replace` rows, the counter
(consecutive calls differ, a seed repeats), low temperatures, -inf logits, no rows, and the
kernel's tokens equal the twin's (the same uniforms). Here, in process: the twin's Philox against
Random123's known-answer vectors, the rows' uniforms, the draws' distribution by a chi-square
test against softmax(z / T) (and against the wrong temperature, which it must fail), input
errors, and the wiring (sampling.sample, DecodeOptions). Generation with the option (the
generator and the multi-turn step, interpreted; slow tier): reproducible under a seed, log-probs
equal a teacher-forced recompute. On a GPU: tests/gpu/test_sample_gpu.py."""

import pytest
import torch

from hybridflow.config import RolloutConfig, load_config
from hybridflow.config_checks import validate_rollout_options
from hybridflow.kernels import sample as ks
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.sampling import sample
from tests.unit.triton_interp import run_check

P8 = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
CHI2_7DOF_P001 = 24.32  # the chi-square distribution's 0.999 quantile at 7 degrees of freedom


def _check(section: str, tmp) -> dict:
    return run_check("sample_rows_check.py", section, tmp, timeout=900)


@pytest.fixture(scope="module")
def kernels_checked(tmp_path_factory):
    return _check("kernels", tmp_path_factory.mktemp("sample_rows"))


def test_kernel_logprobs_equal_log_softmax(kernels_checked):
    cases = kernels_checked["logprobs"]
    assert {(c["dtype"], c["B"], c["nchunk"]) for c in cases} == {
        (d, B, n) for d in ("torch.float32", "torch.bfloat16") for B, n in ((1, 1), (5, 3))}
    for c in cases:
        assert c["lp_err"] < 5e-6 and c["twin_lp_err"] < 5e-6, c
        assert c["tokens_equal_twin"] and c["in_range"] and c["tokens2_in_range"], c
        assert c["dtypes"] == ["torch.int64", "torch.float32"] and c["no_lp"], c
        # key kept, counter + 1 per call (the kernel was called twice, the twin once)
        assert c["counter"] == [11, 2] and c["twin_counter"] == [11, 1], c


def test_kernel_masked_ids_and_replace_as_its_twin(kernels_checked):
    cases = kernels_checked["masked"]
    assert {(c["dtype"], c["B"], c["nchunk"]) for c in cases} == {
        (d, B, n) for d in ("torch.float32", "torch.bfloat16") for B, n in ((1, 1), (6, 3))}
    for c in cases:
        assert c["lp_err"] < 5e-6 and c["twin_lp_err"] < 5e-6, c
        assert c["tokens_differ"] == 0 and not c["masked_drawn"], c
        assert c["given"] == ([5] if c["B"] > 1 else []), c
        assert c["counter"] == [13, 1] and c["twin_counter"] == [13, 1], c


def test_kernel_reads_a_strided_view(kernels_checked):
    c = kernels_checked["strided"]
    assert c["tokens_equal"] and c["max_token"] < 300 and c["lp_err"] < 5e-6, c


def test_kernel_replace_rows(kernels_checked):
    c = kernels_checked["replace"]
    assert c["given_rows"] == [7, 299] and c["drawn_equal"] and c["lp_err"] < 5e-6, c


def test_kernel_stream_advances_and_repeats(kernels_checked):
    c = kernels_checked["stream"]
    assert all(n > 8 for n in c["calls_differ"]), c  # of 32 rows
    assert c["rows_distinct"] >= 5, c  # rows draw from their own words
    assert c["repeat_equal"] and c["other_seed_differs"] > 8, c
    assert c["twin_equal"] == [True, True, True] and c["counter"] == [2024, 3], c


def test_kernel_low_temperature_and_masked_ids(kernels_checked):
    c = kernels_checked["edge"]
    assert c["cold_is_argmax"], c
    assert c["masked_drawn_finite"] and c["row2_token"] == 2000, c
    assert c["lp_finite"] and c["lp_err"] < 5e-6, c
    assert c["empty"] == [[0], [0]] and c["counter"] == [9, 3], c


@pytest.mark.slow
def test_generation_with_the_fused_sampler(tmp_path):
    """The generator (prefill draw and decode steps; eager, and emulated graphs with compaction)
    and the multi-turn step with fused_sampler, interpreted."""
    got = _check("generation", tmp_path)
    g = got["generation"]
    assert g["repeat_equal"] and g["other_seed_differs"] > 10 and g["graphed_equal"], g
    assert g["recompute_err"] < 1e-4 and g["tokens"] > 20 and g["max_id"] < 37, g
    assert g["counter"][0] == 7 and g["counter"][1] >= 2, g  # re-keyed by the seed, advanced
    m = got["multi_turn"]
    assert m["forced_equal"] and m["forced_lp_err"] < 1e-5, m
    assert m["repeat_equal"] and m["other_seed_differs"] > 0 and m["tokens"] > 10, m
    assert m["counters"][0] == 0 and min(m["counters"][1:]) >= 5, m  # only the fused runs draw


# ---- the twin, in process ------------------------------------------------------------------------

def test_philox_known_answers():
    """Random123's Philox4x32-10 known-answer vectors (what tl.philox computes; the interpreted
    kernel draws the twin's words: test_kernel_* above)."""
    t = torch.tensor
    cases = [((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, -1, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0x299F31D0A4093822,
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        assert tuple(int(w) for w in ks.philox4x32(t(key), *map(t, ctr))) == want


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_softmax_over_temperature(temperature):
    """rows x counter steps = 24,576 draws over V = 8 known probabilities at a fixed seed: a
    chi-square test against softmax(log p / T) passes at p = 0.001, one against softmax(log p)
    (the temperature ignored) fails where T != 1. The kernel draws the same tokens from the same
    uniforms (tests above), so this is its distribution too; on a GPU test_sample_gpu.py tests it
    again."""
    z = P8.log()[None].expand(4096, 8).contiguous()
    state = ks.new_rng_state(77, "cpu")
    tokens = torch.cat([ks.sample_rows(z, 1 / temperature, state, impl="torch",
                                       need_logprobs=False)[0] for _ in range(6)])
    target = torch.softmax(P8.log() / temperature, 0)
    assert _chi2(tokens, target) < CHI2_7DOF_P001
    if temperature != 1.0:
        assert _chi2(tokens, P8) > 10 * CHI2_7DOF_P001
    assert int(state[1]) == 6


def test_row_uniforms_in_the_open_interval():
    """The rows' uniforms: in (0, 1) (u x total below the total, so the scan ends at an id with
    mass), mean ~1/2 over 100,000 rows, others at the next counter value."""
    state = ks.new_rng_state(1, "cpu")
    u = ks.row_uniforms(state, 100_000)
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()
    assert abs(u.double().mean().item() - 0.5) < 0.005
    state[1] += 1
    assert (ks.row_uniforms(state, 100_000) != u).float().mean() > 0.99


def test_twin_logprobs_and_replace():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 1000, generator=g) * 3).to(torch.bfloat16)
    x[:, 500:600] = float("-inf")
    where = torch.tensor([True, False, False, True, False, False])
    given = torch.tensor([3, 0, 0, 999, 0, 0])
    tok, lp = ks.sample_rows(x, 0.5, ks.new_rng_state(3, "cpu"), replace=(where, given),
                             impl="torch")
    ref = torch.log_softmax(x.float() * 0.5, -1).gather(1, tok[:, None]).squeeze(1)
    assert tok[where].tolist() == [3, 999] and torch.allclose(lp, ref, atol=1e-5)
    assert not ((tok >= 500) & (tok < 600)).any()


def test_bad_input_names_what_was_expected():
    x = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="rng_state"):
        ks.sample_rows(x, 1.0, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="inv_temp"):
        ks.sample_rows(x, 0.0, ks.new_rng_state(0, "cpu"))
    with pytest.raises(ValueError, match="replace"):
        ks.sample_rows(x, 1.0, ks.new_rng_state(0, "cpu"),
                       replace=(torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long)))
    for chunk, block in ((1000, 256), (128, 256)):
        with pytest.raises(ValueError, match=f"chunk {chunk} is not a multiple of block {block}"):
            ks.sample_rows(x, 1.0, ks.new_rng_state(0, "cpu"), chunk=chunk, block=block)
    with pytest.raises(ValueError, match="block 3072 is not a power of two"):
        ks.sample_rows(x, 1.0, ks.new_rng_state(0, "cpu"), chunk=6144, block=3072)
    with pytest.raises(ValueError, match="logits"):
        ks.sample_rows(torch.zeros(2, 3, 4), 1.0, ks.new_rng_state(0, "cpu"))


# ---- wiring -------------------------------------------------------------------------------------

def test_sample_takes_the_fused_path_only_where_it_applies():
    """sampling.sample with rng_state: kernels "triton", T > 0, no top-k / top-p draws from the
    fused stream (on CPU without the interpreter: the twin) and advances its counter; greedy,
    top-k, top-p or kernels "torch" keep the PyTorch sampler (the torch Generator's draws)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 50, generator=g)
    state = ks.new_rng_state(5, "cpu")
    tok, lp = sample(x, temperature=0.8, kernels="triton", rng_state=state, need_logprobs=True)
    twin = ks.sample_rows(x, 1 / 0.8, ks.new_rng_state(5, "cpu"), impl="torch")
    assert torch.equal(tok, twin[0]) and torch.allclose(lp, twin[1]) and int(state[1]) == 1
    for kw in (dict(temperature=0.8, kernels="torch"), dict(temperature=0.0, kernels="triton"),
               dict(temperature=0.8, kernels="triton", top_k=5),
               dict(temperature=0.8, kernels="triton", top_p=0.9)):
        ref = sample(x, generator=torch.Generator().manual_seed(1), **kw)[0]
        got = sample(x, generator=torch.Generator().manual_seed(1), rng_state=state, **kw)[0]
        assert torch.equal(ref, got), kw
    assert int(state[1]) == 1


def test_fused_sampler_option():
    cfg = RolloutConfig()
    assert cfg.kernel_options.fused_sampler is True
    assert DecodeOptions.from_config(cfg).fused_sampler is True
    cfg.kernel_options.fused_sampler = False
    assert DecodeOptions.from_config(cfg).fused_sampler is False
    validate_rollout_options(cfg)
    cfg.kernel_options.fused_sampler = "yes"
    with pytest.raises(ValueError, match="rollout.kernel_options.fused_sampler"):
        validate_rollout_options(cfg)
    # the inverse CDF is the one fused draw: the former choice of draw is an unknown key
    with pytest.raises(ValueError, match="sampler_draw"):
        load_config(["rollout.kernel_options.sampler_draw=cdf"])


def test_seed_rng_state_in_place():
    state = ks.new_rng_state(2 ** 64 + 5, "cpu")  # any int: its low 63 bits
    ptr = state.data_ptr()
    assert state.tolist() == [5, 0]
    state[1] = 9
    ks.seed_rng_state_(state, 6)
    assert state.tolist() == [6, 0] and state.data_ptr() == ptr
