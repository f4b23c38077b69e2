"""PromptSampler: seeded epochs, DP slicing, exact resume."""

import pytest

from hybridflow.data import PromptSampler


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_union_over_ranks_is_the_global_batch():
    ref = PromptSampler(50, batch_size=8, dp_rank=0, dp_size=1, seed=3)
    ranks = [PromptSampler(50, batch_size=8, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for _ in range(2 * ref.steps_per_epoch + 1):  # crosses epoch boundaries
        expected = ref.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert all(len(p) == 2 for p in parts)
        assert sum(parts, []) == expected and len(set(expected)) == 8


def test_epoch_is_a_permutation_and_epochs_differ():
    s = PromptSampler(20, batch_size=5, dp_rank=0, dp_size=1, seed=0)
    assert s.steps_per_epoch == 4
    epoch0 = sum(list(s), [])
    assert s.epoch == 1 and s.step_in_epoch == 0
    epoch1 = sum(list(s), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(20)) and epoch0 != epoch1


def test_seeds_differ_and_no_shuffle_is_ordered():
    a = take(PromptSampler(100, batch_size=10, dp_rank=0, dp_size=1, seed=0), 3)
    b = take(PromptSampler(100, batch_size=10, dp_rank=0, dp_size=1, seed=1), 3)
    assert a != b
    c = PromptSampler(100, batch_size=10, dp_rank=0, dp_size=1, seed=1, shuffle=False)
    assert c.next_batch() == list(range(10))


def test_resume_mid_epoch_gives_identical_batches():
    full = PromptSampler(37, batch_size=6, dp_rank=1, dp_size=2, seed=11)
    expected = take(full, 15)
    first = PromptSampler(37, batch_size=6, dp_rank=1, dp_size=2, seed=11)
    take(first, 4)
    state = first.state_dict()
    resumed = PromptSampler(37, batch_size=6, dp_rank=1, dp_size=2, seed=11)
    resumed.load_state_dict(state)
    assert take(resumed, 11) == expected[4:]


def test_resume_on_other_dp_size_keeps_global_batches():
    a = PromptSampler(40, batch_size=8, dp_rank=0, dp_size=1, seed=5)
    take(a, 3)
    ranks = [PromptSampler(40, batch_size=8, dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    for s in ranks:
        s.load_state_dict(a.state_dict())
    for _ in range(5):
        assert sum((s.next_batch() for s in ranks), []) == a.next_batch()


def test_drop_last_false_fills_last_batch():
    s = PromptSampler(10, batch_size=4, dp_rank=0, dp_size=1, seed=0, drop_last=False)
    assert s.steps_per_epoch == 3
    batches = list(s)
    assert all(len(b) == 4 for b in batches) and set(sum(batches, [])) == set(range(10))
    assert PromptSampler(10, batch_size=4, dp_rank=0, dp_size=1, seed=0).steps_per_epoch == 2


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match="batch_size 10 is not divisible by dp_size 4"):
        PromptSampler(100, batch_size=10, dp_rank=0, dp_size=4, seed=0)
    with pytest.raises(ValueError, match="fewer than batch_size 8"):
        PromptSampler(5, batch_size=8, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="dp_rank 2"):
        PromptSampler(100, batch_size=8, dp_rank=2, dp_size=2, seed=0)
    s = PromptSampler(100, batch_size=10, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="seed=1"):
        s.load_state_dict({**s.state_dict(), "seed": 1})
    with pytest.raises(ValueError, match="step_in_epoch 10"):
        s.load_state_dict({**s.state_dict(), "step_in_epoch": 10})


def test_restart_epoch_over_new_data():
    """Resuming on other data (trainer.resume_allow_data_change): the saved epoch again, from its
    first batch, over the new row count; batch size, seed and the rest still have to match."""
    old = PromptSampler(24, batch_size=8, dp_rank=0, dp_size=1, seed=1)
    take(old, 4)  # epoch 1, step 1
    new = PromptSampler(16, batch_size=8, dp_rank=0, dp_size=1, seed=1)
    with pytest.raises(ValueError, match="num_items=24"):
        new.load_state_dict(old.state_dict())
    new.load_state_dict(old.state_dict(), restart_epoch=True)
    assert (new.epoch, new.step_in_epoch) == (1, 0)
    fresh = PromptSampler(16, batch_size=8, dp_rank=0, dp_size=1, seed=1)
    take(fresh, 2)  # the same epoch of the new data from its start
    assert take(new, 2) == take(fresh, 2)
    with pytest.raises(ValueError, match="batch_size=8"):
        PromptSampler(16, batch_size=4, dp_rank=0, dp_size=1, seed=1).load_state_dict(
            old.state_dict(), restart_epoch=True)


def test_next_prompts_walks_the_same_order_in_any_pieces():
    """next_prompts(count) takes this rank's slices in order, spanning batches and epochs: any
    split of the counts gives the indices next_batch gives; next_batch after a part takes the
    next batch's worth (the rest of this one, then the next one's start)."""
    whole = PromptSampler(30, batch_size=8, dp_rank=1, dp_size=2, seed=5)
    ref = sum(take(whole, 2 * whole.steps_per_epoch + 1), [])  # crosses two epoch ends
    s = PromptSampler(30, batch_size=8, dp_rank=1, dp_size=2, seed=5)
    got = []
    for count in (3, 1, 0, 6, 2, 5):  # 17 of 28
        got += s.next_prompts(count)
    got += s.next_batch()
    got += s.next_prompts(len(ref) - len(got))
    assert got == ref
    assert s.offset == 0 and (s.epoch, s.step_in_epoch) == (whole.epoch, whole.step_in_epoch)
    with pytest.raises(ValueError, match="count must be >= 0"):
        s.next_prompts(-1)


def test_resume_inside_a_batch():
    """The offset into the current batch is state: a resume goes on inside it. On another DP size
    (other slices) it goes on at the next batch; a state without an offset (older) starts at its
    batch's beginning."""
    a = PromptSampler(40, batch_size=8, dp_rank=0, dp_size=2, seed=1)
    a.next_prompts(6)  # one batch (4) and 2 of the next
    state = a.state_dict()
    assert state["offset"] == 2 and state["dp_size"] == 2
    b = PromptSampler(40, batch_size=8, dp_rank=0, dp_size=2, seed=1)
    b.load_state_dict(state)
    assert b.next_prompts(5) == a.next_prompts(5)
    c = PromptSampler(40, batch_size=8, dp_rank=0, dp_size=4, seed=1)
    c.load_state_dict(state)
    ref = PromptSampler(40, batch_size=8, dp_rank=0, dp_size=4, seed=1)
    take(ref, 2)
    assert (c.step_in_epoch, c.offset) == (2, 0) and c.next_batch() == ref.next_batch()
    old = {k: v for k, v in state.items() if k not in ("offset", "dp_size")}
    d = PromptSampler(40, batch_size=8, dp_rank=0, dp_size=2, seed=1)
    d.load_state_dict(old)
    assert (d.step_in_epoch, d.offset) == (1, 0)
    for bad in (-1, "2"):
        with pytest.raises(ValueError, match="offset must be a non-negative int"):
            d.load_state_dict({**state, "offset": bad})
    with pytest.raises(ValueError, match="past the local batch size"):
        d.load_state_dict({**state, "offset": 4})
