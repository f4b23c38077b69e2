"""The speculative tail's n-gram drafts made on the device (rollout.speculative.device_steps).

The host drafter (speculative.NgramDrafter) needs the emitted tokens back after every tail step:
one device-to-host read, the Python drafting and a copy of the drafts in, with the GPU idle in
between. Here the rows' contexts (prompt + response so far) live in a device buffer and the same
rule runs as tensor ops inside the captured tail step, so several steps run per graph replay and
the host reads the rows' finished flags once per replay.

The rule, as NgramDrafter applies it: for n from ngram_max down to ngram_min, the last position
e <= L - 1 (L the context's length) whose preceding n tokens equal the context's last n tokens;
the first n with a match gives c = e, and the drafts are ctx[c + j % (L - c)], j < k (the
continuation, repeated with period L - c past the context's end). No match: no drafts.

Shapes: ctx (B, W) int64 with W >= every context's length + the tokens one step appends (its tail
columns are scratch for masked writes), ctx_len (B,) int64. Everything is static-shaped and free of
host syncs (graph-capturable).
"""

from __future__ import annotations

import torch


def draft(ctx: torch.Tensor, ctx_len: torch.Tensor, *, k: int, sizes: list,
          limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts (B, k) int64, zero past each row's count; counts (B,) int64): the module
    docstring's rule, at most `limit` (B,) drafts per row (<= 0: none)."""
    B, W = ctx.shape
    dev = ctx.device
    found = torch.full((B,), -1, dtype=torch.long, device=dev)
    for n in sizes:  # longest n-gram first: a row keeps the first n that matches
        at = (ctx_len[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)
        suffix = ctx.gather(1, at)  # (B, n) the context's last n tokens
        # window w holds ctx[w .. w + n - 1], continued at e = w + n <= L - 1
        hit = (ctx.unfold(1, n, 1) == suffix[:, None, :]).all(-1)  # (B, W - n + 1)
        w = torch.arange(W - n + 1, device=dev)
        hit &= w <= (ctx_len - 1 - n)[:, None]
        last = (hit.long() * (w + 1 + n)).amax(1) - 1  # the last matching e, -1: none
        found = torch.where(found < 0, last, found)
    count = torch.where(found >= 0, limit.clamp(min=0, max=k), 0)
    period = (ctx_len - found).clamp(min=1)
    j = torch.arange(k, device=dev)
    cols = (found.clamp(min=0)[:, None] + j % period[:, None]).clamp(max=W - 1)
    drafts = torch.where(j < count[:, None], ctx.gather(1, cols), 0)
    return drafts, count


def append(ctx: torch.Tensor, ctx_len: torch.Tensor, tokens: torch.Tensor,
           count: torch.Tensor) -> None:
    """Each row's first count[i] of tokens (B, S) onto its context, in place (the rest go to the
    buffer's last S columns, scratch)."""
    B, W = ctx.shape
    S = tokens.shape[1]
    j = torch.arange(S, device=ctx.device)
    cols = torch.where(j < count[:, None], ctx_len[:, None] + j, W - S + j)
    ctx.scatter_(1, cols, tokens)
    ctx_len.add_(count)
