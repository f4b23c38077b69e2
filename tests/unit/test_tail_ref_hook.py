"""Generator.generate(tail=...) on CPU: once compaction moves the live rows into a bucket of at most
`tail.live_rows`, the rows finished by then are handed over, built as the returned batch builds
them, while decoding goes on; the generation itself is unchanged by it."""

import dataclasses

import torch

from hybridflow.rollout.generator import TailHook
from tests.unit.test_compaction import random_prompts, uneven_stops
from tests.unit.test_rollout import CFG, make, polled, rc


class Recorder(TailHook):
    def __init__(self, live_rows: int):
        self.live_rows = live_rows
        self.calls = []

    def start(self, rows, batch):
        self.calls.append((rows.clone(), batch))


def _uneven(gen, prompts, R, **kw):
    free = polled(gen, 2)(prompts, cfg=rc(max_new_tokens=R), eos_id=-1, pad_id=0, seed=0)
    stops = uneven_stops(free.response_ids, [0, 5, 14], CFG.vocab_size)
    return rc(max_new_tokens=R, stop_token_ids=stops[1:], compact_finished_rows=True, **kw), stops[0]


def test_finished_rows_handed_over_as_the_batch_has_them():
    gen, R = make(), 40
    generate = polled(gen, 2)
    prompts = random_prompts(24, vocab=CFG.vocab_size)
    cfg, eos = _uneven(gen, prompts, R, max_batch_size=24)
    tail = Recorder(live_rows=4)
    out = generate(prompts, cfg=cfg, eos_id=eos, pad_id=99, seed=0, tail=tail)
    ref = generate(prompts, cfg=cfg, eos_id=eos, pad_id=99, seed=0)
    for name in ("response_ids", "response_mask", "prompt_ids", "prompt_mask", "group_ids"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    assert torch.equal(out.rollout_logprobs, ref.rollout_logprobs)

    assert len(tail.calls) == 1
    rows, early = tail.calls[0]
    lengths = out.response_mask.sum(1)
    assert 12 <= len(rows) <= 21 and (lengths[rows] < R).all()  # only stopped rows
    assert set(rows.tolist()).isdisjoint({0, 5, 14})  # the three rows that never stop
    assert early.response_ids.device.type == "cpu"
    w = early.response_ids.shape[1]
    assert w == int(lengths[rows].max())  # trimmed to its own longest row
    sub = out.select(rows)
    for name in ("prompt_ids", "prompt_mask", "group_ids", "indices"):
        assert torch.equal(getattr(early, name), getattr(sub, name)), name
    assert torch.equal(early.response_ids, sub.response_ids[:, :w])
    assert torch.equal(early.response_mask, sub.response_mask[:, :w])
    assert torch.equal(early.rollout_logprobs, sub.rollout_logprobs[:, :w])
    assert (sub.response_mask[:, w:] == 0).all()


def test_not_called_without_a_small_enough_bucket_or_with_several_chunks():
    gen, R = make(), 40
    generate = polled(gen, 2)
    prompts = random_prompts(24, vocab=CFG.vocab_size)
    cfg, eos = _uneven(gen, prompts, R, max_batch_size=24)
    tail = Recorder(live_rows=2)  # three rows never stop: no bucket of 2 is ever reached
    generate(prompts, cfg=cfg, eos_id=eos, pad_id=99, seed=0, tail=tail)
    assert gen.stats["compactions"] >= 1 and tail.calls == []
    tail = Recorder(live_rows=4)
    generate(prompts, cfg=dataclasses.replace(cfg, max_batch_size=10), eos_id=eos, pad_id=99,
             seed=0, tail=tail)  # three chunks: rows would not be the call's
    assert gen.stats["compactions"] >= 1 and tail.calls == []
    generate(prompts, cfg=dataclasses.replace(cfg, compact_finished_rows=False), eos_id=eos,
             pad_id=99, seed=0, tail=tail)
    assert tail.calls == []
