"""Partial rollouts (rollout.partial): a capped decode per step, unfinished rows carried over.

Each DP rank keeps the prompt groups in flight (`PartialRollouts.groups`, oldest first). A step:
1. tops the in-flight groups up to prompts_per_step / DP + extra_prompts / DP with fresh prompts
   (`fresh_needed`; the caller draws them, a sampler batch at a time, and keeps the rest queued);
2. generates every unfinished row of them in one call (`gen_rows`: rows of n = 1, each prompt the
   row's prompt + the response so far) with at most `max_decode_steps` new tokens; a row keeps at
   most max_new_tokens response tokens in all (a continuation that decodes past its remaining
   budget is cut there, as the uncapped decode would have been);
3. trains on exactly prompts_per_step / DP complete groups (every one of the n rows stopped or at
   max_new_tokens), oldest first; when fewer are complete, or a group has waited `max_staleness`
   steps, the needed unfinished rows are finished in a second call without the cap (the oldest
   groups first);
4. keeps the rest in flight: incomplete groups (their rows' tokens and rollout log-probs, from the
   policies that sampled them) and complete groups beyond the step's share (trained next step).

So every step trains the same number of groups per rank (batch shapes, mini-batches and DP stay as
they are), and the step's decode is cut at the cap unless too few groups completed. A carried row's
earlier tokens were sampled by an older policy: their rollout log-probs are kept, so
algo.tis_imp_ratio_cap (truncated importance sampling) corrects them and rollout_corr/* measures the
mismatch. The continuation re-prefills prompt + partial response (no KV cache kept across steps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hybridflow.data.batch import RolloutBatch


@dataclass
class Row:
    prompt: list  # the prompt's token ids
    tokens: list = field(default_factory=list)  # response so far
    logprobs: list = field(default_factory=list)  # rollout log-prob of each response token
    done: bool = False


@dataclass
class Group:
    item: object  # the dataset item (prompt_ids, index, ground truth, ...)
    born: int  # the step that drew it
    rows: list

    @property
    def complete(self) -> bool:
        return all(r.done for r in self.rows)


class PartialRollouts:
    def __init__(self, *, n: int, max_new_tokens: int, stop_ids, max_decode_steps: int,
                 max_staleness: int, local_groups: int, local_extra: int):
        self.n, self.R, self.stop_ids = n, max_new_tokens, set(stop_ids)
        self.cap, self.max_staleness = max_decode_steps, max_staleness
        self.local_groups, self.local_extra = local_groups, local_extra
        self.groups: list[Group] = []

    def fresh_needed(self) -> int:
        return max(self.local_groups + self.local_extra - len(self.groups), 0)

    def add(self, items, step: int) -> None:
        for it in items:
            self.groups.append(Group(it, step, [Row(list(it.prompt_ids)) for _ in range(self.n)]))

    def _extend(self, rows: list, batch: RolloutBatch) -> None:
        """Append generated tokens (rows of `batch`, in order) to `rows`, within the budget."""
        lengths = batch.response_mask.sum(1).tolist()
        for i, row in enumerate(rows):
            new = batch.response_ids[i, :lengths[i]].tolist()[:self.R - len(row.tokens)]
            lps = batch.rollout_logprobs[i, :len(new)].tolist()
            row.tokens += new
            row.logprobs += lps
            row.done = bool(new and new[-1] in self.stop_ids) or len(row.tokens) >= self.R

    def _generate(self, groups: list, gen_rows: Callable, max_new: int, anywhere) -> int:
        rows = [r for g in groups for r in g.rows if not r.done]
        if anywhere is not None and anywhere(bool(rows)) and not rows:
            # another DP rank generates: join it (MoE's expert gather before generation is a
            # collective over EP, which spans DP ranks) on one throw-away row
            gen_rows([self.groups[0].rows[0].prompt], max_new)
            return 0
        if not rows:
            return 0
        batch = gen_rows([r.prompt + r.tokens for r in rows], max_new)
        self._extend(rows, batch)
        return int(batch.response_mask.sum(1).max())

    def step(self, gen_rows: Callable[[list, int], RolloutBatch], step: int,
             anywhere: Optional[Callable[[bool], bool]] = None):
        """Steps 2-4 of the module doc on the in-flight groups (already topped up) ->
        (the groups to train on, oldest first; metrics of this rank). `anywhere(has_rows)`: whether
        any DP rank has rows for a call (None: a single rank); every rank then makes the call."""
        carried_rows = sum(not r.done for g in self.groups if g.born < step for r in g.rows)
        decode = self._generate(self.groups, gen_rows, self.cap, anywhere)
        complete = [g for g in self.groups if g.complete]
        short = max(self.local_groups - len(complete), 0)
        incomplete = [g for g in self.groups if not g.complete]  # oldest first
        finish = [g for k, g in enumerate(incomplete)
                  if k < short or step - g.born >= self.max_staleness]
        finish_rows = sum(not r.done for g in finish for r in g.rows)
        # uncapped: the longest remaining budget, rounded up to a multiple of the cap (few
        # distinct lengths: a kept generator captures decode graphs per length)
        budget = max([self.R - len(r.tokens) for g in finish for r in g.rows if not r.done]
                     or [self.cap])
        budget = min(-(-budget // self.cap) * self.cap, self.R)
        decode += self._generate(finish, gen_rows, budget, anywhere)  # (every rank: it may join)
        ready = [g for g in self.groups if g.complete]  # oldest first (in-flight order)
        take = ready[:self.local_groups]
        taken = {id(g) for g in take}
        self.groups = [g for g in self.groups if id(g) not in taken]
        metrics = {"partial/carried_rows": float(carried_rows),
                   "partial/carried_groups": float(len(self.groups)),
                   "partial/staleness_max": float(max(step - g.born for g in take)),
                   "partial/decode_steps": float(decode),
                   "partial/finished_uncapped_rows": float(finish_rows)}
        return take, metrics

    def batch(self, groups: list, *, pad_id: int, first_group: int) -> RolloutBatch:
        """The rows of `groups` (n consecutive rows each) as a RolloutBatch (CPU) with group ids
        first_group + j, dataset indices and rollout log-probs."""
        rows = [r for g in groups for r in g.rows]
        P = max(len(r.prompt) for r in rows)
        W = max(max(len(r.tokens) for r in rows), 1)
        B = len(rows)
        p_ids = torch.full((B, P), pad_id, dtype=torch.long)
        p_mask = torch.zeros((B, P), dtype=torch.long)
        r_ids = torch.full((B, W), pad_id, dtype=torch.long)
        r_mask = torch.zeros((B, W), dtype=torch.long)
        lps = torch.zeros((B, W), dtype=torch.float32)
        for i, r in enumerate(rows):
            p_ids[i, P - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
            p_mask[i, P - len(r.prompt):] = 1
            r_ids[i, :len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
            r_mask[i, :len(r.tokens)] = 1
            lps[i, :len(r.tokens)] = torch.tensor(r.logprobs, dtype=torch.float32)
        gids = (first_group + torch.arange(len(groups))).repeat_interleave(self.n)
        idx = torch.tensor([g.item.index for g in groups]).repeat_interleave(self.n)
        return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids,
                            response_mask=r_mask, group_ids=gids, indices=idx,
                            rollout_logprobs=lps)


def batch_size_warning(*, local_groups: int, local_extra: int, n: int, gen_replicas: int,
                       max_batch_size: int):
    """A start-up warning when the first step's rows per generate call (every in-flight group's n
    rows) exceed rollout.max_batch_size: the call then runs in chunks, each paying the cap again."""
    rows = -(-(local_groups + local_extra) * n // gen_replicas)
    if rows <= max_batch_size:
        return None
    return (f"hybridflow: warning: rollout.partial generates up to {rows} rows per call (the "
            f"in-flight groups, data.prompts_per_step + rollout.partial.extra_prompts per DP rank, "
            f"x rollout.n={n}) in chunks of rollout.max_batch_size={max_batch_size}, one after "
            f"another; set rollout.max_batch_size={rows} where memory allows")


def row_items(prompts: list) -> list:
    """Stand-in dataset items for RolloutStage.generate over raw rows (n = 1)."""
    return [_RowItem(p) for p in prompts]


@dataclasses.dataclass
class _RowItem:
    prompt_ids: list
    index: int = 0
