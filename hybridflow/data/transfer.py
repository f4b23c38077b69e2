"""Many small host tensors to the device in one copy.

A pass's micro-batches are dataclasses of a dozen host tensors each (ids, masks, log-probs, a packed
row's positions and gather indices): ~20 tensors per micro-batch. Copied one by one from pageable
memory, every copy is a synchronous staged transfer that first waits for the stream; here they are
laid side by side in one pinned buffer (each at a 16-byte-aligned offset) and moved by one
non-blocking copy, and each field becomes a view of its bytes on the device. The pinned buffer comes
from PyTorch's caching host allocator, which keeps it from reuse until the copy has run."""

from __future__ import annotations

import dataclasses

import torch

_ALIGN = 16


def to_device(items: list, device) -> list:
    """`items` (dataclass instances; None passes through) with every tensor field on `device`.
    Fields already there are kept as they are; on a CPU device nothing moves."""
    device = torch.device(device)
    if device.type != "cuda":
        return [None if x is None else dataclasses.replace(x, **{k: t.to(device) for k, t in
                                                                  _fields(x)}) for x in items]
    if device.index is None:  # as the tensors on it name it
        device = torch.device("cuda", torch.cuda.current_device())
    slots, total = _layout(items, device)
    if not slots:
        return list(items)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    _fill(host, slots)
    return _rebuild(items, host.to(device, non_blocking=True), slots)


def _layout(items: list, device: torch.device) -> tuple[list, int]:
    """[(item index, field, tensor, byte offset)] of the tensors not on `device`, and the bytes."""
    slots, total = [], 0
    for i, x in enumerate(items):
        for name, t in ([] if x is None else _fields(x)):
            if t.device == device:
                continue
            slots.append((i, name, t, total))
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return slots, total


def _fill(buf: torch.Tensor, slots: list) -> None:
    for _, _, t, off in slots:
        _view(buf, t, off).copy_(t)


def _rebuild(items: list, buf: torch.Tensor, slots: list) -> list:
    moved = [{} for _ in items]
    for i, name, t, off in slots:
        moved[i][name] = _view(buf, t, off)
    return [x if x is None or not moved[i] else dataclasses.replace(x, **moved[i])
            for i, x in enumerate(items)]


def _fields(x) -> list:
    return [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)
            if isinstance(getattr(x, f.name), torch.Tensor)]


def _view(buf: torch.Tensor, like: torch.Tensor, off: int) -> torch.Tensor:
    n = like.numel() * like.element_size()
    return buf[off:off + n].view(like.dtype).view(like.shape)

