"""Small collectives over a group of ranks: sums, and gathering RolloutBatches.

The one way to gather batches: every member may hold a different number of rows and widths (a DP
rank's trimmed share, a gen replica's chunk). `gather_batches` pads prompts on the LEFT and
responses on the RIGHT to the widest member (ids with the pad id, masks and per-token values with 0),
all-gathers every field and returns one batch per member, in group-rank order, each with its own
rows and the common widths (`RolloutBatch.widened`). `all_gather_batch` concatenates them
(`RolloutBatch.cat`): global row r*B_local + i is member r's row i on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel.groups import device


def dp_sum(x: float, *, group) -> float:
    if dist.get_world_size(group) == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device())
    dist.all_reduce(t, group=group)
    return float(t.item())


def dp_max(x: float, *, group) -> float:
    if dist.get_world_size(group) == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def gather_batches(batch: RolloutBatch, *, group, pad_id: int) -> list[RolloutBatch]:
    size = dist.get_world_size(group)
    if size == 1:
        return [batch]
    dims = torch.tensor([batch.batch_size, batch.prompt_len, batch.response_ids.shape[1]],
                        dtype=torch.int64, device=device())
    all_dims = [torch.empty_like(dims) for _ in range(size)]
    dist.all_gather(all_dims, dims, group=group)
    rows = [int(d[0]) for d in all_dims]
    b, p, r = (max(int(d[k]) for d in all_dims) for k in range(3))
    wide = batch.widened(prompt_len=p, response_len=r, pad_id=pad_id)
    out = {}
    for f in dataclasses.fields(wide):
        t = getattr(wide, f.name)
        if t is None:
            out[f.name] = None
            continue
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, b - t.shape[0]))  # rows, to the most
        t = t.to(device()).contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        out[f.name] = [part[:n].cpu() for part, n in zip(parts, rows)]
    return [RolloutBatch(**{k: (v[i] if v is not None else None) for k, v in out.items()})
            for i in range(size)]


def all_gather_batch(batch: RolloutBatch, *, group, pad_id: int) -> RolloutBatch:
    if dist.get_world_size(group) == 1:
        return batch
    return RolloutBatch.cat(gather_batches(batch, group=group, pad_id=pad_id), pad_id=pad_id)
