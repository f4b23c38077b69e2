"""Tool results held and appended together (rollout.multi_turn.append_wait_steps /
append_batch_rows): with results that come in at different decode steps (a tool whose call completes
a fixed number of polls after it was submitted, so the timing is deterministic), holding appends
them in fewer `extend` calls, each result at most append_wait_steps steps after it came in, and the
rollout (forced turns: the same tokens whatever the timing) is the one appended at once, its
log-probs those of a from-scratch forward over the whole conversation."""

from concurrent.futures import Future

import pytest
import torch

from hybridflow.rollout import multi_turn
from hybridflow.tools.runner import ToolRunner
from tests.unit.test_multi_turn import (byte_tokenizer, call, make_gen, reference_logprobs, run,
                                        tool_config)


class PolledFuture(Future):
    """Completes at its `polls`-th done() (the decode loop asks once per poll, i.e. per step), or
    when the loop blocks for a result and it is the nearest (polled_wait)."""

    def __init__(self, value, polls: int):
        super().__init__()
        self._value, self.left = value, polls

    def done(self):
        if not super().done():
            self.left -= 1
            if self.left <= 0:
                self.set_result(self._value)
        return super().done()


def polled_wait(fs, return_when):
    """concurrent.futures.wait for PolledFutures: blocking for one completes the nearest."""
    if not any(Future.done(f) for f in fs):
        near = min(fs, key=lambda f: f.left)
        near.set_result(near._value)
    return WAIT(fs, return_when=return_when)


class PolledRunner(ToolRunner):
    """Runs a turn's calls (the real tools) at once; each result comes in 2-4 polls later."""

    def submit(self, items):
        self.submitted = getattr(self, "submitted", 0) + 1
        return PolledFuture(self._run(items), polls=2 + self.submitted % 3)


COLLECT, EXTEND_ROWS, WAIT = multi_turn._collect, multi_turn._extend_rows, multi_turn.wait


def record(monkeypatch):
    """[(decode step, rows)] of the polls' results that came in and of the append extend calls."""
    came, appended = [], []
    collect, extend_rows = COLLECT, EXTEND_ROWS

    def collect_rec(pending, rows, **kw):
        done = collect(pending, rows, **kw)
        if done:
            came.append((kw["stats"]["decode_steps"], sorted(done)))
        return done

    def extend_rec(order, *args, stats, **kw):
        appended.append((stats["decode_steps"], sorted(order)))
        return extend_rows(order, *args, stats=stats, **kw)

    monkeypatch.setattr(multi_turn, "_collect", collect_rec)
    monkeypatch.setattr(multi_turn, "_extend_rows", extend_rec)
    monkeypatch.setattr(multi_turn, "wait", polled_wait)
    return came, appended


def test_held_results_are_appended_together_within_the_bound(tmp_path, monkeypatch):
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "q"}]))
    # row 0 decodes on past every call (results never wait for a stalled batch); rows 1-6 close
    # their calls 4 steps apart, so with their 2-4 poll delays the results come in one by one
    forced = [tok.encode("a" * 160) + end] + [
        tok.encode("b" * (4 * i) + call(f"{i}+{i}")) + tok.encode("ok") + end for i in range(1, 7)]
    path = tool_config(tmp_path, "calculator")
    outs = {}
    for wait, rows in ((0, 64), (8, 64), (1000, 3)):
        came, appended = record(monkeypatch)
        (batch, m), _ = run(make_gen(), tok, "hermes", path, [prompt] * 7, forced, max_new=320,
                            temperature=0.0, runner_cls=PolledRunner, append_wait_steps=wait,
                            append_batch_rows=rows)
        outs[wait] = batch, m, came, appended
        arrived = {b: s for s, done in came for b in done}
        at = {b: s for s, order in appended for b in order}
        assert sorted(arrived) == sorted(at) == list(range(1, 7))
        assert all(0 <= at[b] - arrived[b] <= wait for b in arrived), (wait, came, appended)
        assert m["multi_turn/append_calls"] == len(appended)
        assert m["multi_turn/append_rows_mean"] == pytest.approx(6 / len(appended))
    (b0, m0, came0, app0), (b8, m8, _, _), (bn, mn, _, appn) = outs.values()
    assert len(came0) == 6 and [o for _, o in app0] == [d for _, d in came0]  # each at once
    assert m8["multi_turn/append_calls"] < m0["multi_turn/append_calls"] == 6
    assert [o for _, o in outs[8][3]] == [[1, 2, 3], [4, 5, 6]]  # 8 steps after rows 1 and 4
    # append_batch_rows=3 with no step bound: two appends of three rows
    assert [len(o) for _, o in appn] == [3, 3] and mn["multi_turn/append_rows_mean"] == 3
    for batch in (b8, bn):  # the same rollout, whenever the results were appended
        assert torch.equal(batch.response_ids, b0.response_ids)
        assert torch.equal(batch.tool_mask, b0.tool_mask)
        torch.testing.assert_close(batch.rollout_logprobs, b0.rollout_logprobs, rtol=1e-5,
                                   atol=1e-5)
    gen = make_gen()
    for b in range(7):  # held rows' caches: a from-scratch forward's log-probs
        n = int(b8.response_mask[b].sum())
        tool = b8.tool_mask[b, :n].bool()
        assert tool.any() == (b > 0)
        ref = reference_logprobs(gen, prompt, b8.response_ids[b, :n].tolist())
        torch.testing.assert_close(b8.rollout_logprobs[b, :n][~tool], ref[~tool], rtol=1e-4,
                                   atol=1e-4)


def test_a_result_is_appended_at_once_when_nothing_else_decodes(tmp_path, monkeypatch):
    """Both rows wait for their calls (closed at the same step, the results 3 and 4 polls later):
    the first result in is appended at once however long the hold (no step runs without work
    while a result is in), the second no later than the first row stops decoding."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "q"}]))
    forced = [tok.encode(call("1+1")) + tok.encode("ok" * 20) + end,
              tok.encode(call("2+2")) + tok.encode("ok") + end]
    outs = []
    for wait in (0, 1000):
        came, appended = record(monkeypatch)
        (batch, m), _ = run(make_gen(), tok, "hermes", tool_config(tmp_path, "calculator"),
                            [prompt] * 2, forced, temperature=0.0, runner_cls=PolledRunner,
                            append_wait_steps=wait, append_batch_rows=64)
        outs.append(batch)
        assert appended[0] == came[0] and len(came) == 2 and batch.tool_mask.any(1).all()
    assert torch.equal(outs[0].response_ids, outs[1].response_ids)
    # held: appended at the step row 0 stopped (its 41 tokens after the result), not 1000 later
    assert appended[1][0] == appended[0][0] + 41 and appended[1][0] > came[1][0]
