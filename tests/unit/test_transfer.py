"""One pinned buffer for a pass's micro-batches: the byte layout (on CPU) and, where CUDA is,
the copy itself."""

import dataclasses
from typing import Optional

import pytest
import torch

from hybridflow.data import transfer
from hybridflow.data.batch import RolloutBatch
from hybridflow.data.packing import pack_rows


@dataclasses.dataclass
class Mixed:
    ids: torch.Tensor
    flags: torch.Tensor
    values: torch.Tensor
    empty: torch.Tensor
    count: int
    maybe: Optional[torch.Tensor] = None


def _items():
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompt_ids=torch.randint(1, 100, (3, 5), generator=g), prompt_mask=torch.ones(3, 5).long(),
        response_ids=torch.randint(1, 100, (3, 7), generator=g),
        response_mask=(torch.arange(7)[None] < torch.tensor([[7], [2], [4]])).long(),
        group_ids=torch.arange(3), indices=torch.arange(3),
        old_logprobs=torch.randn(3, 7, generator=g))
    mixed = Mixed(ids=torch.arange(5, dtype=torch.int32), flags=torch.tensor([True, False, True]),
                  values=torch.randn(4, 6, generator=g).t(),  # not contiguous
                  empty=torch.zeros(0, 3, dtype=torch.int64), count=3)
    return [batch, pack_rows(batch), None, mixed]


def _same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y.cpu(), x), f.name
        else:
            assert y == x, f.name


def test_layout_round_trip_keeps_every_field_at_an_aligned_offset():
    items = _items()
    slots, total = transfer._layout(items, torch.device("meta"))
    assert [off % 16 for *_, off in slots] == [0] * len(slots)
    assert total % 16 == 0 and len(slots) == sum(
        isinstance(getattr(x, f.name), torch.Tensor)
        for x in items if x is not None for f in dataclasses.fields(x))
    buf = torch.empty(total, dtype=torch.uint8)
    transfer._fill(buf, slots)
    out = transfer._rebuild(items, buf.clone(), slots)
    assert out[2] is None
    for a, b in zip(items, out):
        if a is not None:
            _same(a, b)
    # the views share the one buffer and none overlaps another
    spans = sorted((off, off + t.numel() * t.element_size()) for *_, t, off in slots)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))


def test_cpu_device_moves_nothing_and_keeps_values():
    items = _items()
    for a, b in zip(items, transfer.to_device(items, "cpu")):
        assert (a is None) == (b is None)
        if a is not None:
            _same(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_equals_per_tensor_copies():
    items = _items()
    out = transfer.to_device(items, "cuda")
    for a, b in zip(items, out):
        if a is not None:
            _same(a, b)
            assert all(getattr(b, f.name).is_cuda for f in dataclasses.fields(b)
                       if isinstance(getattr(b, f.name), torch.Tensor))
    again = transfer.to_device(out, "cuda")  # already there: kept, not copied again
    assert again[0].prompt_ids.data_ptr() == out[0].prompt_ids.data_ptr()
