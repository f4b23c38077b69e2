"""Small collectives over the data-parallel group: sums and gathering a RolloutBatch.

Each DP rank holds its share of the step's batch (possibly trimmed to different widths). Gathering
pads prompts on the left and responses on the right to the widest rank, then concatenates in DP-rank
order, so global row r*B_local + i is rank r's row i on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel.groups import device


def dp_sum(x: float) -> float:
    if ps.get_data_parallel_world_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device())
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t.item())


def _dp_max(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return int(t.item())


def all_gather_batch(batch: RolloutBatch) -> RolloutBatch:
    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return batch
    p, r = _dp_max(batch.prompt_len), _dp_max(batch.response_ids.shape[1])
    out = {}
    for f in dataclasses.fields(batch):
        t = getattr(batch, f.name)
        if t is None:
            out[f.name] = None
            continue
        if f.name.startswith("prompt_"):
            t = F.pad(t, (p - t.shape[1], 0))
        elif t.dim() == 2:
            t = F.pad(t, (0, r - t.shape[1]))
        t = t.to(device()).contiguous()
        parts = [torch.empty_like(t) for _ in range(dp)]
        dist.all_gather(parts, t, group=ps.get_data_parallel_group())
        out[f.name] = torch.cat(parts).cpu()
    return RolloutBatch(**out)
