"""Partial rollouts (hybridflow/rollout/partial.py) on a tiny CPU generator: with a decode cap that
forces carry-over, carried rows continue exactly where they stopped (greedy: the tokens of one
uncapped generation), their earlier log-probs are the ones recorded when they were sampled, the
trained groups are complete, staleness and the shortfall rule hold; the in-flight state a checkpoint
keeps round-trips and is dealt to the DP ranks; and the config checks."""

import dataclasses

import pytest
import torch

from hybridflow.config import Config
from hybridflow.config_checks import validate_partial
from hybridflow.rollout.partial import PartialRollouts, deal, restore
from tests.unit.test_rollout import make, rc

R, N, CAP = 14, 2, 4


@dataclasses.dataclass
class Item:
    prompt_ids: list
    index: int


def _items(num: int, vocab: int = 37):
    g = torch.Generator().manual_seed(3)
    return [Item(torch.randint(1, vocab, (int(torch.randint(2, 7, (1,), generator=g)),),
                               generator=g).tolist(), i) for i in range(num)]


@pytest.fixture(scope="module")
def setup():
    gen, items = make(), _items(12)
    free = gen.generate([it.prompt_ids for it in items], cfg=rc(max_new_tokens=R, n=1),
                        eos_id=-1, pad_id=0, seed=0)
    # a stop id that ends some rows early and leaves others running to R: the token most rows
    # produce somewhere past the cap
    counts = torch.bincount(free.response_ids[:, CAP:].flatten(), minlength=40)
    eos = int(counts.argmax())
    ref = gen.generate([it.prompt_ids for it in items], cfg=rc(max_new_tokens=R, n=1),
                       eos_id=eos, pad_id=0, seed=0)
    lengths = ref.response_mask.sum(1)
    assert (lengths > CAP).any() and (lengths <= CAP).any(), lengths
    return gen, items, eos, ref


def _run(setup, *, extra: int, steps: int, max_staleness: int = 5, local: int = 2):
    gen, items, eos, ref = setup
    calls = []

    def gen_rows(prompts, max_new):
        calls.append(max_new)
        return gen.generate(prompts, cfg=rc(max_new_tokens=max_new, n=1), eos_id=eos, pad_id=0,
                            seed=0)

    pr = PartialRollouts(n=N, max_new_tokens=R, stop_ids=[eos], max_decode_steps=CAP,
                         max_staleness=max_staleness, local_groups=local, local_extra=extra)
    queue, recorded, out = list(items), {}, []
    for step in range(steps):
        need = pr.fresh_needed()
        pr.add(queue[:need], step)
        queue = queue[need:]
        groups, metrics = pr.step(gen_rows, step)
        out.append((step, groups, metrics))
        # max_staleness: no incomplete group is left that has waited that many steps
        assert all(g.complete or step - g.born < max_staleness for g in pr.groups)
        assert metrics["partial/carried_groups"] == len(pr.groups)
        for g in pr.groups:  # what each carried row holds when its step ends
            for r in g.rows:
                recorded[id(r)] = (list(r.tokens), list(r.logprobs))
    return out, recorded, calls


def test_carried_rows_continue_exactly_where_they_stopped(setup):
    gen, items, eos, ref = setup
    out, recorded, calls = _run(setup, extra=2, steps=4)
    assert sum(m["partial/carried_rows"] for _, _, m in out) > 0  # the cap carried rows over
    lengths = ref.response_mask.sum(1).tolist()
    trained = 0
    for step, groups, metrics in out:
        assert len(groups) == 2  # every step trains local_groups complete groups
        for g in groups:
            want = ref.response_ids[g.item.index, :lengths[g.item.index]].tolist()
            want_lp = ref.rollout_logprobs[g.item.index, :len(want)]
            for r in g.rows:
                assert r.done and r.tokens == want  # greedy: the uncapped generation's tokens
                torch.testing.assert_close(torch.tensor(r.logprobs), want_lp, atol=1e-4, rtol=0)
                if id(r) in recorded:  # carried: the earlier tokens' log-probs are the recorded
                    toks, lps = recorded[id(r)]
                    assert r.tokens[:len(toks)] == toks and r.logprobs[:len(lps)] == lps
                    trained += 1
    assert trained > 0
    # each step's first call is capped; a second (uncapped) one only finishes a shortfall
    assert calls.count(CAP) >= len(out)
    assert all(m > CAP or m == CAP for m in calls)
    uncapped = [m for m in calls if m > CAP]
    assert len(uncapped) == sum(m["partial/finished_uncapped_rows"] > 0 for _, _, m in out)


def test_batch_holds_complete_groups_with_recorded_logprobs(setup):
    gen, items, eos, ref = setup
    out, _, _ = _run(setup, extra=2, steps=3)
    pr = PartialRollouts(n=N, max_new_tokens=R, stop_ids=[eos], max_decode_steps=CAP,
                         max_staleness=5, local_groups=2, local_extra=2)
    for _, groups, _ in out:
        b = pr.batch(groups, pad_id=0, first_group=6)
        assert b.batch_size == 2 * N and b.group_ids.tolist() == [6, 6, 7, 7]
        assert b.indices.tolist() == [g.item.index for g in groups for _ in range(N)]
        L = b.response_mask.sum(1)
        for i in range(b.batch_size):
            last = int(b.response_ids[i, L[i] - 1])
            assert last == eos or L[i] == R  # complete: stopped or at max_new_tokens
            row = groups[i // N].rows[i % N]
            assert b.response_ids[i, :L[i]].tolist() == row.tokens
            assert b.rollout_logprobs[i, :L[i]].tolist() == pytest.approx(row.logprobs)
            assert b.prompt_ids[i, b.prompt_len - len(row.prompt):].tolist() == row.prompt


def test_shortfall_and_staleness_finish_uncapped(setup):
    # no slack: a step finishes the groups it lacks without the cap, so nothing waits
    out, _, calls = _run(setup, extra=0, steps=3)
    assert any(m > CAP for m in calls)
    for step, groups, m in out:
        assert len(groups) == 2 and m["partial/staleness_max"] == 0
    # much slack, max_staleness=1: stale groups are finished (checked in _run); complete groups
    # wait their turn, oldest first, so a step trains the oldest ones
    out, _, _ = _run(setup, extra=4, steps=4, max_staleness=1)
    for step, groups, m in out:
        assert [g.born for g in groups] == sorted(g.born for g in groups)
        assert m["partial/staleness_max"] == max(step - g.born for g in groups)


def _in_flight(items, *, n=N):
    pr = PartialRollouts(n=n, max_new_tokens=R, stop_ids=[5], max_decode_steps=CAP,
                         max_staleness=2, local_groups=2, local_extra=1)
    pr.add(items[:3], 0)
    pr.add(items[3:4], 1)
    g = torch.Generator().manual_seed(0)
    for k, grp in enumerate(pr.groups):
        for j, r in enumerate(grp.rows):
            r.tokens = torch.randint(1, 37, (k + 2 * j,), generator=g).tolist()
            r.logprobs = (-torch.rand(len(r.tokens), generator=g)).tolist()  # float32 values
            r.done = j == 0
    return pr


def _groups(pr):
    return [(g.item.index, g.born, [(r.prompt, r.tokens, r.logprobs, r.done) for r in g.rows])
            for g in pr.groups]


def test_in_flight_state_round_trips_exactly():
    """A checkpoint's in-flight groups come back as they were: dataset item, step drawn, every
    row's tokens, recorded log-probs (bit for bit) and done flag; an empty row too."""
    items = _items(6)
    pr = _in_flight(items)
    assert any(not r.tokens for g in pr.groups for r in g.rows)
    back = _in_flight(items[4:])  # other groups, replaced by the loaded ones
    back.load_state_dict(pr.state_dict(), lambda i: items[i])
    assert _groups(back) == _groups(pr) and all(
        b.item is items[b.item.index] for b in back.groups)


def test_deal_gives_each_rank_its_own_or_every_group_in_turn():
    grp = lambda index, born: (index, born)  # noqa: E731  (deal reads the step drawn only)
    saved = [{"groups": [grp(0, 0), grp(1, 2)], "queue": [10, 11]},
             {"groups": [grp(2, 1)], "queue": [12]}]
    assert deal(saved, dp_size=2, dp_rank=1) is saved[1]
    assert deal(saved, dp_size=1, dp_rank=0) == {"groups": [grp(0, 0), grp(2, 1), grp(1, 2)],
                                                 "queue": [10, 11, 12]}
    assert [deal(saved, dp_size=3, dp_rank=r) for r in range(3)] == [
        {"groups": [grp(0, 0)], "queue": [10]}, {"groups": [grp(2, 1)], "queue": [11]},
        {"groups": [grp(1, 2)], "queue": [12]}]


def test_restore_puts_groups_back_or_says_why_it_drops_them():
    items = _items(6)
    saved = [{"groups": _in_flight(items).state_dict(), "queue": [4, 5]}]
    pr = _in_flight(items[4:])
    queue, line = restore(pr, saved, dataset=items, dp_size=1, dp_rank=0, restart_epoch=False)
    assert line is None and queue == items[4:6] and _groups(pr) == _groups(_in_flight(items))
    for args, why in (((None, saved), "rollout.partial.enable=false"),
                      ((_in_flight(items, n=3), saved), "rollout.n=3 differs"),
                      ((pr, saved, True), "the training data changed")):
        queue, line = restore(*args[:2], dataset=items, dp_size=1, dp_rank=0,
                              restart_epoch=args[2] if len(args) > 2 else False)
        assert queue == [] and why in line and "6 prompt groups" in line, line
    assert restore(pr, None, dataset=items, dp_size=1, dp_rank=0, restart_epoch=False) == ([], None)
    _, line = restore(pr, None, dataset=items, dp_size=1, dp_rank=0, restart_epoch=False,
                      legacy_count=3)
    assert "3 prompt groups" in line and "older hybridflow" in line


def _cfg(**partial):
    cfg = Config()
    cfg.rollout.return_logprobs = True
    cfg.rollout.max_new_tokens = 64
    cfg.rollout.partial = dataclasses.replace(cfg.rollout.partial, enable=True, **partial)
    return cfg


def test_config_checks_name_the_keys():
    validate_partial(_cfg(max_decode_steps=16), dp=1)
    validate_partial(Config(), dp=1)  # off: nothing checked
    with pytest.raises(ValueError, match="rollout.partial.max_decode_steps"):
        validate_partial(_cfg(max_decode_steps=64), dp=1)
    with pytest.raises(ValueError, match="rollout.partial.extra_prompts"):
        validate_partial(_cfg(max_decode_steps=16, extra_prompts=3), dp=2)
    with pytest.raises(ValueError, match="rollout.partial.max_staleness"):
        validate_partial(_cfg(max_decode_steps=16, max_staleness=0), dp=1)
    cfg = _cfg(max_decode_steps=16)
    cfg.rollout.return_logprobs = False
    with pytest.raises(ValueError, match="rollout.return_logprobs"):
        validate_partial(cfg, dp=1)
    cfg = _cfg(max_decode_steps=16)
    cfg.rollout.multi_turn.enable = True
    with pytest.raises(ValueError, match="rollout.multi_turn.enable"):
        validate_partial(cfg, dp=1)
    cfg = _cfg(max_decode_steps=16)
    cfg.algo.dynamic_sampling.enable = True  # rounds of complete in-flight groups
    validate_partial(cfg, dp=1)


def test_a_round_takes_its_prompt_batches_worth_of_groups(setup):
    """`take` (a dynamic-sampling round of k prompt batches): the in-flight groups are topped up
    to take + k x extra (each prompt batch its slack), and the step returns exactly `take`
    complete groups, oldest first."""
    gen, items, eos, ref = setup
    pr = PartialRollouts(n=N, max_new_tokens=R, stop_ids=[eos], max_decode_steps=CAP,
                         max_staleness=5, local_groups=2, local_extra=1)
    assert pr.fresh_needed() == 3 and pr.fresh_needed(4) == 6 and pr.fresh_needed(6) == 9
    pr.add(items[:6], 0)

    def gen_rows(prompts, max_new):
        return gen.generate(prompts, cfg=rc(max_new_tokens=max_new, n=1), eos_id=eos, pad_id=0,
                            seed=0)

    groups, _ = pr.step(gen_rows, 0, take=4)
    assert len(groups) == 4 and all(g.complete for g in groups) and len(pr.groups) == 2
    assert pr.fresh_needed(4) == 4


def test_a_rank_without_rows_joins_the_other_ranks_calls():
    """Every DP rank makes the same calls (MoE's expert gather is a collective over EP, across DP):
    a rank whose groups are all complete generates one throw-away row when another rank generates,
    and makes no call when none does; its groups are not touched."""
    items = _items(3)
    for others_generate, want_calls in ((True, 2), (False, 0)):
        pr = PartialRollouts(n=N, max_new_tokens=R, stop_ids=[0], max_decode_steps=CAP,
                             max_staleness=1, local_groups=2, local_extra=1)
        pr.add(items, 0)
        for g in pr.groups:
            for r in g.rows:
                r.tokens, r.logprobs, r.done = [5, 0], [-1.0, -2.0], True
        calls, asked = [], []

        def gen_rows(prompts, max_new):
            calls.append(prompts)
            return make().generate(prompts, cfg=rc(max_new_tokens=max_new, n=1), eos_id=0,
                                   pad_id=0, seed=0)

        def anywhere(has):
            asked.append(has)
            return has or others_generate

        groups, m = pr.step(gen_rows, 1, anywhere=anywhere)
        assert asked == [False, False] and len(calls) == want_calls
        assert all(c == [items[0].prompt_ids] for c in calls)
        assert [g.item.index for g in groups] == [0, 1] and m["partial/decode_steps"] == 0
        assert [r.tokens for g in groups for r in g.rows] == [[5, 0]] * 4


def test_batch_size_warning_names_the_rows():
    from hybridflow.rollout.partial import batch_size_warning

    for ok in (576, 768):  # room for the carried rows (the first step alone runs in chunks)
        assert batch_size_warning(local_groups=64, local_extra=32, n=8, gen_replicas=1,
                                  max_batch_size=ok) is None
    note = batch_size_warning(local_groups=64, local_extra=32, n=8, gen_replicas=1,
                              max_batch_size=512)
    assert "512 fresh rows" in note and "about 576" in note and "or 768" in note
