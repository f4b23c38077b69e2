"""Micro-batches by token budget (verl's dynamic batch size), as a pure function of row lengths.

A micro-batch is run padded: every row is [prompt left-padded to the micro-batch's longest prompt |
response right-padded to its longest response] (`RolloutBatch.trimmed`), so its cost in tokens is
rows x (P_mb + R_mb), rounded up to a multiple of TP under sequence parallel. `token_budget_groups`
splits a batch's rows into micro-batches whose padded size stays within `max_tokens`.

Algorithm (sorted next-fit, deterministic): rows sorted longest first; walk them in that order and
add each to the open micro-batch while its padded size still fits, else open a new one. Sorting puts
rows of similar length together, so a micro-batch of short rows is not padded to the batch's longest
one and holds many more rows. Two orders are tried, by prompt + response length and by response
length (then prompt length), and the one with fewer padded tokens (then fewer micro-batches) kept:
prompts and responses are padded separately, and which order groups them better depends on which
varies more (GSM8K-like lengths, prompts 67-232 and responses to 1,024: the response order pads ~6%
less). Ties in either order go by row index. The last micro-batch holds the shortest rows and may be
small. A row that alone exceeds the budget gets a
micro-batch of its own (config validation keeps that from happening to RL rows; a supervised
warm-up row may be longer than any response). Every TP rank holds the same rows, so it builds the
same micro-batches. Balancing micro-batches across DP ranks is not done here: each DP rank splits its
own rows (verl balances rows across DP ranks first; the rollout here gives each DP rank its own
prompts' groups).

`balanced` (algo.balance_micro_batches; packed micro-batches only, whose cost is their real
tokens): the rows are instead dealt into the fewest micro-batches that hold them, as evenly as
possible (verl's dynamic batches: a balanced partition into ceil(tokens / budget) micro-batches).
Rows go longest first, each to the emptiest micro-batch it fits in (LPT); where that leaves a row
without room, one micro-batch more is tried, up to next-fit's count, whose groups are the fallback.
So a batch a few rows past k budgets runs k + 1 micro-batches of about equal size instead of k full
ones and one of the last few rows, and one that next-fit spills over only through its waste runs k.
"""

from __future__ import annotations

import torch


def padded_tokens(prompt_len: int, response_len: int, rows: int, *, multiple: int = 1) -> int:
    """Tokens of `rows` rows padded to prompt_len + response_len, rounded up to `multiple`."""
    return rows * _round_up(prompt_len + response_len, multiple)


def token_budget_groups(prompt_lens: torch.Tensor, response_lens: torch.Tensor, *, max_tokens: int,
                        multiple: int = 1, packed: bool = False,
                        balanced: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch, longest rows first; together a permutation of range(B).

    prompt_lens, response_lens: (B,) real tokens of each row (prompt_mask / response_mask sums).
    A response is counted at least 1 long, as `RolloutBatch.trimmed` keeps one response column.
    `packed`: a micro-batch costs its rows' real tokens (sequence packing, hybridflow.data.packing),
    rounded up to `multiple`, instead of rows x its longest prompt + response.
    `balanced` (with `packed`): the fewest micro-batches, evenly filled (the module docstring).
    """
    assert prompt_lens.shape == response_lens.shape and prompt_lens.dim() == 1
    p = [int(x) for x in prompt_lens.tolist()]
    r = [max(int(x), 1) for x in response_lens.tolist()]
    by_total = sorted(range(len(p)), key=lambda i: (-(p[i] + r[i]), -r[i], i))
    by_response = sorted(range(len(p)), key=lambda i: (-r[i], -p[i], i))
    candidates = [_next_fit(order, p, r, max_tokens=max_tokens, multiple=multiple, packed=packed)
                  for order in (by_total, by_response)]

    def cost(groups):
        tokens = sum(_cost(len(g), max(p[i] for i in g), max(r[i] for i in g),
                           sum(p[i] + r[i] for i in g), multiple=multiple, packed=packed)
                     for g in groups)
        return tokens, len(groups)

    best = min(candidates, key=cost)  # the first on a tie
    if not (balanced and packed):
        return best
    sizes = [p[i] + r[i] for i in by_total]
    least = -(-sum(sizes) // max_tokens)
    for k in range(max(least, 1), len(best) + 1):
        groups = _dealt(by_total, sizes, k, max_tokens=max_tokens, multiple=multiple)
        if groups is not None:
            return groups
    return best


def _dealt(order: list[int], sizes: list[int], k: int, *, max_tokens: int,
           multiple: int) -> list[list[int]] | None:
    """`order`'s rows (longest first; `sizes` their tokens) dealt into k packed micro-batches, each
    to the emptiest one it still fits in; None when a row fits in none."""
    groups: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i, n in zip(order, sizes):
        fits = [g for g in range(k) if _round_up(load[g] + n, multiple) <= max_tokens]
        if not fits:  # (a row over the whole budget never fits: next-fit runs it alone)
            return None
        g = min(fits, key=lambda j: (load[j], j))
        groups[g].append(i)
        load[g] += n
    return [g for g in groups if g]


def _cost(rows: int, longest_p: int, longest_r: int, real: int, *, multiple: int,
          packed: bool) -> int:
    """Tokens a micro-batch computes: its `real` tokens packed (rounded up to `multiple`), or
    `rows` rows padded to its longest prompt + response."""
    if packed:
        return _round_up(real, multiple)
    return padded_tokens(longest_p, longest_r, rows, multiple=multiple)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _next_fit(order: list[int], p: list[int], r: list[int], *, max_tokens: int,
              multiple: int, packed: bool = False) -> list[list[int]]:
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_p = cur_r = cur_real = 0
    for i in order:
        new_p, new_r, new_real = max(cur_p, p[i]), max(cur_r, r[i]), cur_real + p[i] + r[i]
        if cur and _cost(len(cur) + 1, new_p, new_r, new_real, multiple=multiple,
                         packed=packed) > max_tokens:
            groups.append(cur)
            cur, new_p, new_r, new_real = [], p[i], r[i], p[i] + r[i]
        cur.append(i)
        cur_p, cur_r, cur_real = new_p, new_r, new_real
    if cur:
        groups.append(cur)
    return groups
