"""Micro-batches by token budget (hybridflow.data.microbatch) and the config keys that turn them on."""

import pytest
import torch

from hybridflow.config import load_config, micro_batching
from hybridflow.config_checks import validate
from hybridflow.data.microbatch import padded_tokens, token_budget_groups


def _lengths(n: int, seed: int):
    """GSM8K-like rows: prompts 67-232 tokens, responses log-normal (mean ~300) with a tail to 1024."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(67, 233, (n,), generator=g)
    r = torch.exp(torch.randn(n, generator=g) * 0.6 + 5.55).clamp(1, 1024).long()
    r[torch.rand(n, generator=g) < 0.04] = 1024
    return p, r


def _cost(groups, p, r, multiple=1):
    return sum(padded_tokens(int(p[g].max()), int(r[g].clamp(min=1).max()), len(g),
                             multiple=multiple) for g in groups)


@pytest.mark.parametrize("multiple", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_partition_rows_within_budget_next_fit(seed, multiple):
    p, r = _lengths(200, seed)
    budget = 8192
    groups = token_budget_groups(p, r, max_tokens=budget, multiple=multiple)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(200))  # every row exactly once
    for g in groups:  # within the budget, counted as the engine pads: P_mb + R_mb, rounded up
        assert padded_tokens(int(p[g].max()), int(r[g].max()), len(g), multiple=multiple) <= budget
    # next-fit in one of the two documented orders (longest first): rows in that order, and the
    # first row of each micro-batch would not have fitted into the one before
    totals, resp = (p + r).tolist(), r.tolist()
    by_total = sorted(range(200), key=lambda i: (-(totals[i]), -resp[i], i))
    by_response = sorted(range(200), key=lambda i: (-resp[i], -(totals[i] - resp[i]), i))
    assert flat in (by_total, by_response)
    for prev, nxt in zip(groups, groups[1:]):
        grown = prev + [nxt[0]]
        assert padded_tokens(int(p[grown].max()), int(r[grown].max()), len(grown),
                             multiple=multiple) > budget


def test_far_less_padding_than_fixed_micro_batches():
    """The point of the exercise: on GSM8K-like lengths, half the padded tokens of fixed
    micro-batches padded to the batch's longest row (and no more micro-batches at the same
    per-micro-batch size)."""
    p, r = _lengths(512, 0)
    fixed = padded_tokens(int(p.max()), int(r.max()), 512)  # 16 micro-batches of 32 rows
    groups = token_budget_groups(p, r, max_tokens=32 * (int(p.max()) + int(r.max())))
    assert len(groups) <= 16
    assert _cost(groups, p, r) < 0.55 * fixed
    assert _cost(groups, p, r) >= int((p + r).sum())  # padded never below the real tokens


def test_a_row_longer_than_the_budget_runs_alone_and_empty_responses_count_one():
    p = torch.tensor([4, 3, 2, 5])
    r = torch.tensor([30, 2, 0, 1])  # row 0: 34 tokens > budget 20; row 2: no response token
    groups = token_budget_groups(p, r, max_tokens=20)
    assert groups[0] == [0]
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    # the other three together: 3 x (5 + 2) = 21 > 20; so two of them, then the shortest
    assert [len(g) for g in groups] == [1, 2, 1]


def _cfg(*overrides, world_size=1):
    cfg = load_config(["experiment=demo", *overrides])
    validate(cfg, world_size=world_size)
    return cfg


def test_keys_default_auto_and_micro_batching_reads_them():
    from hybridflow.config_auto import resolve_auto

    assert _cfg().algo.use_dynamic_bsz is None  # auto: decided for the device
    a = resolve_auto(_cfg(), device_type="cpu")[0].algo
    assert (a.use_dynamic_bsz, a.pack_sequences) == (False, False)
    assert micro_batching(a, forward=True)["max_tokens"] is None
    a = _cfg("algo.use_dynamic_bsz=true", "algo.max_tokens_per_micro_batch_per_gpu=500",
             "algo.micro_batch_size_per_gpu=3").algo  # 3 divides nothing: unused with budgets
    assert micro_batching(a, forward=False) == {"micro_batch_size": 3, "max_tokens": 500,
                                                "pack": False}
    assert micro_batching(a, forward=True)["max_tokens"] == 500
    a = _cfg("algo.use_dynamic_bsz=true", "algo.forward_max_tokens_per_micro_batch_per_gpu=900").algo
    assert micro_batching(a, forward=True)["max_tokens"] == 900
    assert micro_batching(a, forward=False)["max_tokens"] == a.max_tokens_per_micro_batch_per_gpu


@pytest.mark.parametrize("overrides, world_size, match", [
    (["algo.max_tokens_per_micro_batch_per_gpu=95", "data.max_prompt_length=64",
      "rollout.max_new_tokens=32"], 1,
     r"algo.max_tokens_per_micro_batch_per_gpu=95 .*data.max_prompt_length \+ "
     r"rollout.max_new_tokens = 64 \+ 32 = 96"),
    (["algo.forward_max_tokens_per_micro_batch_per_gpu=10"], 1,
     r"algo.forward_max_tokens_per_micro_batch_per_gpu=10"),
    (["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
      "algo.max_tokens_per_micro_batch_per_gpu=97", "data.max_prompt_length=64",
      "rollout.max_new_tokens=33"], 2, r"multiple of TP=2 \(sequence parallel\) = 98"),
    (["parallel.pipeline_parallel_size=2"], 2, r"algo.use_dynamic_bsz=true needs "
                                                r"parallel.pipeline_parallel_size=1"),
])
def test_bad_budgets_name_the_keys(overrides, world_size, match):
    with pytest.raises(ValueError, match=match):
        _cfg("algo.use_dynamic_bsz=true", *overrides, world_size=world_size)


@pytest.mark.parametrize("overrides, world_size", [
    (["algo.use_dynamic_bsz=false"], 1),  # token budgets off
    (["algo.use_dynamic_bsz=true", "parallel.pipeline_parallel_size=2"], 2),
])
def test_pack_sequences_needs_budgets_and_no_pipeline(overrides, world_size):
    with pytest.raises(ValueError, match=r"algo.pack_sequences=true needs algo.use_dynamic_bsz=true "
                                         r".*parallel.pipeline_parallel_size=1"):
        _cfg("algo.pack_sequences=true", *overrides, world_size=world_size)
    with pytest.raises(ValueError, match=r"model.attention_backend=sdpa or auto \(got 'local'\)"):
        _cfg("algo.pack_sequences=true", "algo.use_dynamic_bsz=true",
             "model.attention_backend=local")
    a = _cfg("algo.pack_sequences=true", "algo.use_dynamic_bsz=true").algo
    assert micro_batching(a, forward=True)["pack"] is True


def test_packed_attention_option_errors():
    assert _cfg().algo.packed_attention == "auto"
    with pytest.raises(ValueError, match=r"algo.packed_attention='fa2' is not one of "
                                         r"\['auto', 'fa4', 'flex', 'varlen'\]"):
        _cfg("algo.packed_attention=fa2")
    for kernel in ("varlen", "fa4"):
        with pytest.raises(ValueError, match=rf"algo.packed_attention={kernel} needs "
                                             r"trainer.precision=bf16"):
            _cfg(f"algo.packed_attention={kernel}", "trainer.precision=fp32")
    for ok in ("auto", "varlen", "fa4"):
        assert _cfg(f"algo.packed_attention={ok}").algo.packed_attention == ok


@pytest.mark.parametrize("multiple", [1, 2])
def test_packed_groups_count_real_tokens(multiple):
    p, r = _lengths(200, 0)
    budget = 8192
    groups = token_budget_groups(p, r, max_tokens=budget, multiple=multiple, packed=True)
    assert sorted(i for g in groups for i in g) == list(range(200))
    real = [sum(int(p[i]) + max(int(r[i]), 1) for i in g) for g in groups]
    assert all(-(-t // multiple) * multiple <= budget for t in real)
    # fewer micro-batches than padded budgets need: packing fills the budget with real tokens
    assert len(groups) < len(token_budget_groups(p, r, max_tokens=budget, multiple=multiple))


def _real(groups, p, r):
    return [sum(int(p[i]) + max(int(r[i]), 1) for i in g) for g in groups]


@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_groups_are_the_fewest_and_even(seed, multiple):
    """algo.balance_micro_batches: a permutation of the rows in micro-batches within the budget,
    no more of them than next-fit makes, at least ceil(tokens / budget), filled evenly (the
    fullest and the emptiest differ by less than the longest row), longest rows first."""
    p, r = _lengths(512, seed)
    budget = 20480
    kw = dict(max_tokens=budget, multiple=multiple, packed=True)
    nf = token_budget_groups(p, r, **kw)
    groups = token_budget_groups(p, r, **kw, balanced=True)
    assert sorted(i for g in groups for i in g) == list(range(512))
    real = _real(groups, p, r)
    assert all(-(-t // multiple) * multiple <= budget for t in real)
    assert -(-sum(real) // budget) <= len(groups) <= len(nf)
    assert max(real) - min(real) < int((p + r.clamp(min=1)).max())
    for g in groups:
        sizes = [int(p[i]) + max(int(r[i]), 1) for i in g]
        assert sizes == sorted(sizes, reverse=True)
    assert [p[g[0]] + r[g[0]] for g in groups] == sorted((p[g[0]] + r[g[0]] for g in groups),
                                                         reverse=True)


def test_balanced_groups_spread_the_overflow_and_fill_next_fits_waste():
    """A batch a few rows past k budgets: next-fit runs k full micro-batches and one of the last
    rows; balanced runs k + 1 of about equal size. A batch next-fit spills over only through its
    waste (under k budgets in all): balanced runs k."""
    budget = 1000
    # 13 rows of 250 tokens: next-fit fills 3 x 1,000 and leaves one row; balanced 1,000 + 3 x 750
    p = torch.full((13,), 50)
    r = torch.full((13,), 200)
    nf = token_budget_groups(p, r, max_tokens=budget, packed=True)
    bal = token_budget_groups(p, r, max_tokens=budget, packed=True, balanced=True)
    assert len(bal) == len(nf) == 4
    assert min(_real(nf, p, r)) == 250 and sorted(_real(bal, p, r)) == [750, 750, 750, 1000]
    # 6 rows of 450 and 2 of 50 (2,800 tokens, 3 budgets): next-fit's pairs of 450 waste 100 each
    # and spill the last two rows into a fourth micro-batch; dealt evenly they fit in three
    p = torch.full((8,), 50)
    r = torch.tensor([400] * 6 + [1] * 2)
    nf = token_budget_groups(p, r, max_tokens=budget, packed=True)
    bal = token_budget_groups(p, r, max_tokens=budget, packed=True, balanced=True)
    assert len(nf) == 4 and len(bal) == 3
    # not packed: a padded micro-batch's cost is not its real tokens; next-fit as before
    assert token_budget_groups(p, r, max_tokens=budget, balanced=True) == \
        token_budget_groups(p, r, max_tokens=budget)


def test_balance_needs_packed_micro_batches():
    for off in ("algo.pack_sequences=false", "algo.use_dynamic_bsz=false"):
        with pytest.raises(ValueError, match="algo.balance_micro_batches=true deals packed"):
            _cfg("algo.balance_micro_batches=true", off)
    assert _cfg("algo.balance_micro_batches=true").algo.balance_micro_batches


def test_balance_defaults_to_packing():
    """auto (null): balanced wherever the micro-batches are packed, next-fit elsewhere; an explicit
    false keeps next-fit under packing."""
    from hybridflow.config_auto import resolve_auto

    def resolved(*o, device="cuda"):
        return resolve_auto(_cfg(*o), device_type=device)[0].algo

    assert _cfg().algo.balance_micro_batches is None
    a = resolved()
    assert a.pack_sequences and a.balance_micro_batches
    assert not resolved(device="cpu").balance_micro_batches  # CPU: not packed unless asked
    assert resolved("algo.pack_sequences=true", device="cpu").balance_micro_batches
    assert not resolved("algo.pack_sequences=false").balance_micro_batches
    assert not resolved("algo.balance_micro_batches=false").balance_micro_batches
