"""Row compaction of the decode batch: stop paying for rows that have finished.

A chunk of B rows decodes in a batch bucket of b >= B rows (cuda_graph.py) and, without this, keeps
all b rows until the last one stops: with a long tail of response lengths (GSM8K: mean ~300 tokens,
~1% of rows at the 1,024 cap) nearly every decode step attends over every row's cache. Compaction
moves the live rows into a smaller bucket as rows finish.

Algorithm, at the stop-poll points (every DecodeOptions.check_every decode steps):
1. `StopPoller` snapshots the live-row count (sum of ~finished) asynchronously, as it did the done
   flag: the decision uses the previous poll's snapshot, so no host sync. Rows only ever finish, so
   the (stale) count is an upper bound on the rows live now.
2. `target_bucket`: the smallest ladder bucket >= that count, taken only when it is at most HALF
   the current bucket (hysteresis: every compaction at least halves the decode work, so a chunk
   compacts at most log2(b) times and the gather traffic is a geometric series; a move for a saving
   of one row would cost a gather and, on GPU, a graph for little), or, from the cap when it is not
   a power of two (rollout.max_batch_size=1536), the power of two below it (1,024: a third of the
   work saved, where waiting for half would decode at the cap until 512 rows are left). The ladder
   is `bucket_sizes(max_batch_size)` (powers of two, the cap on top); with CUDA graphs only buckets
   >= DecodeOptions.min_graphed_bucket are used: each ladder bucket is captured up front (before
   the seed, like the chunk buckets), and at a few rows a decode step costs about the same (weight
   reads and launches), so smaller graphs would be capture time for nothing.
3. `compact`, all on the device and without learning which rows are live on the host: a stable
   argsort of `finished` puts the unfinished rows first (in their order); the first new_b rows of
   that order hold every live row. Their state (tokens, positions, key_valid, finished, output
   columns so far; cur and step are shared) is gathered into the smaller bucket's static buffers,
   their KV-cache rows into the cache's first new_b rows (index_select into a temporary, then copy:
   source and destination overlap), one layer at a time over the columns written so far (bounds
   the temporary), and the row map (bucket row -> chunk row, B for bucket padding) is gathered
   alike. Decoding continues with the smaller bucket's step (its own graph: all buckets share one
   cache and one pool, so the graphs stay valid).
4. `flush`: before each compaction and at the end, the current buffers' output rows are scattered
   into the chunk's (B + 1, R) output by the row map (row B is the trash row of bucket padding).
   A row dropped at a compaction has finished, so its output is complete at that flush; kept rows
   are overwritten by later flushes.

What it changes in the result: per row the math is the same (rows are independent in decode), but
a matmul's rounding may depend on the batch size (the BLAS picks its kernel by the row count: on
CPU fp32, fewer than 4 rows round differently, ~1e-6 in a log-prob). So greedy tokens and masks
equal the uncompacted run's, and log-probs do to that rounding (bit-equal while the buckets keep
>= 4 rows on CPU); in bf16 on GPU a greedy near-tie may flip, exactly as when max_batch_size
changes. Sampled runs stay reproducible for a fixed seed and identical on every TP_g rank (the
counts, hence the decisions, are the same there), but the random stream depends on the batch
size (a draw of b rows consumes b rows of Philox / CPU generator output), so sampled tokens differ
from the uncompacted run's: another, equally valid sample. `rollout.compact_finished_rows=false`
turns it off.
"""

from __future__ import annotations

from typing import Optional

import torch


def ladder(bucket_sizes: list[int], *, graphed: bool, min_graphed: int) -> list[int]:
    """The compaction targets, ascending: under CUDA graphs (`graphed`) those of at least
    `min_graphed` rows."""
    return [b for b in bucket_sizes if not graphed or b >= min_graphed]


def target_bucket(live: int, current: int, targets: list[int]) -> Optional[int]:
    """The bucket to compact `current` rows into when at most `live` rows are unfinished, or None
    (no ladder bucket fits, or the saving is under half: hysteresis; from a cap that is not a power
    of two, the power of two below it as well)."""
    fit = next((b for b in targets if b >= max(live, 1)), None)
    if fit is None or fit >= current:
        return None
    return fit if fit <= current // 2 or fit == below_cap(current) else None


def below_cap(current: int) -> Optional[int]:
    """The power of two below `current` when `current` is not one (a cap bucket), else None."""
    return None if current & (current - 1) == 0 else 1 << (current.bit_length() - 1)


def flush(buf, row_map: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
          experts: Optional[torch.Tensor] = None) -> None:
    """Scatter the bucket's output rows into the chunk's tokens / logprobs (B + 1, R) (and routed
    `experts` (B + 1, R, L, k) when recorded) by row_map (b,) (row B: bucket padding)."""
    tokens.index_copy_(0, row_map, buf.out_tokens)
    logprobs.index_copy_(0, row_map, buf.out_logprobs)
    if experts is not None:
        experts.index_copy_(0, row_map, buf.out_experts)


def compact(src, dst, cache, row_map: torch.Tensor, *, columns: int) -> torch.Tensor:
    """Move src's unfinished rows (and enough finished ones to fill it) into dst's bucket and the
    cache's first dst rows; return the new row map (dst rows,). `columns`: cache columns written
    so far (the rest is masked out by key_valid and never read)."""
    old_b, new_b = src.finished.shape[0], dst.finished.shape[0]
    assert new_b < old_b, (new_b, old_b)
    order = torch.argsort(src.finished.int(), stable=True)[:new_b]  # live rows first
    names = ["tokens", "positions", "finished", "key_valid", "out_tokens", "out_logprobs"]
    if src.out_experts is not None:  # recording the routed experts (the same in both buckets)
        names.append("out_experts")
    for name in names:
        getattr(dst, name).copy_(getattr(src, name).index_select(0, order))
    dst.cur.copy_(src.cur)
    dst.step.copy_(src.step)
    cache.gather_rows(order, columns=columns)
    return row_map.index_select(0, order)
