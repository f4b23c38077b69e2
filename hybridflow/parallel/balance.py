"""Rows balanced across DP ranks by tokens (verl's `trainer.balance_batch`).

Each DP rank generates its own prompts' groups, so one rank may hold many long responses and another
many short ones; every pass after generation (old_log_prob, ref, values, the updates) then waits for
the rank with the most tokens. `balance_rows` re-deals the step's rows: the batch is all-gathered
over DP (in rank order, as compute_advantages gathers it), the rows are partitioned into DP parts of
equal row count and near-equal tokens (`partition`), and each rank keeps its part. Group ids stay
global, so group statistics do not move with the rows; with one mini-batch per step the update sums
the same rows' gradients over the same global normalisers as without balancing.

`partition`: rows sorted by tokens, longest first (ties by row index), each to the part with the
fewest tokens among those with room left (ties by part index): deterministic, the same on every
rank. Its largest part exceeds the mean by at most the longest row.
"""

from __future__ import annotations

import torch

from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel.dp import all_gather_batch


def partition(tokens: list[int], parts: int) -> list[list[int]]:
    """Row indices of `parts` parts of len(tokens) / parts rows each (sorted ascending)."""
    n = len(tokens)
    if n % parts:
        raise ValueError(f"{n} rows cannot be dealt to {parts} DP ranks in equal numbers")
    size = n // parts
    load, out = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(n), key=lambda i: (-tokens[i], i)):
        p = min((p for p in range(parts) if len(out[p]) < size), key=lambda p: (load[p], p))
        out[p].append(i)
        load[p] += tokens[i]
    return [sorted(rows) for rows in out]


def balance_rows(batch: RolloutBatch, *, group, rank: int, parts: int,
                 pad_id: int) -> tuple[RolloutBatch, dict]:
    """This DP rank's part of the step's rows, and verl's `global_seqlen/*` metrics (tokens per
    rank before and after)."""
    full = all_gather_batch(batch, group=group, pad_id=pad_id)
    tokens = full.token_mask().sum(1).tolist()
    size = batch.batch_size
    before = [sum(tokens[r * size:(r + 1) * size]) for r in range(parts)]
    dealt = partition(tokens, parts)
    after = [sum(tokens[i] for i in rows) for rows in dealt]
    mine = full.select(torch.tensor(dealt[rank], dtype=torch.long)).trimmed()
    metrics = {"global_seqlen/min": float(min(before)), "global_seqlen/max": float(max(before)),
               "global_seqlen/minmax_diff": float(max(before) - min(before)),
               "global_seqlen/balanced_min": float(min(after)),
               "global_seqlen/balanced_max": float(max(after)),
               "global_seqlen/mean": sum(before) / parts}
    return mine, metrics
