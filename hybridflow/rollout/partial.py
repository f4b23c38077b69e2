"""Partial rollouts (rollout.partial): a capped decode per step, unfinished rows carried over.

Each DP rank keeps the prompt groups in flight (`PartialRollouts.groups`, oldest first). A step:
1. tops the in-flight groups up to prompts_per_step / DP + extra_prompts / DP with fresh prompts
   (`fresh_needed`; the caller draws them, a sampler batch at a time, and keeps the rest queued;
   a dynamic-sampling round of k prompt batches: k times both);
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

Checkpoints keep the groups in flight (`state_dict`: each group's dataset index, the step that drew
it, its rows' tokens, rollout log-probs and done flags), so a resumed run continues them: `deal`
hands each DP rank its own groups back, or, saved at another DP size, every group to one rank in
turn, oldest first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

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

    def fresh_needed(self, take: Optional[int] = None) -> int:
        """Fresh groups to add before a step (or round) that trains `take` groups (None:
        local_groups): the in-flight groups topped up to take + local_extra per prompt batch of
        local_groups (a dynamic-sampling round of k batches keeps k x local_extra, the slack a
        step has for its one batch)."""
        take = self.local_groups if take is None else take
        batches = -(-take // self.local_groups)
        return max(take + batches * self.local_extra - len(self.groups), 0)

    def add(self, items, step: int) -> None:
        for it in items:
            self.groups.append(Group(it, step, [Row(list(it.prompt_ids)) for _ in range(self.n)]))

    def state_dict(self) -> list:
        """The groups in flight, oldest first: (dataset index, step drawn, response lengths (n,),
        tokens (sum of lengths,), rollout log-probs (float32, as recorded), done (n,)) each."""
        out = []
        for g in self.groups:
            out.append((int(g.item.index), int(g.born),
                        torch.tensor([len(r.tokens) for r in g.rows], dtype=torch.long),
                        torch.tensor([t for r in g.rows for t in r.tokens], dtype=torch.long),
                        torch.tensor([p for r in g.rows for p in r.logprobs],
                                     dtype=torch.float32),
                        torch.tensor([r.done for r in g.rows], dtype=torch.bool)))
        return out

    def load_state_dict(self, groups: list, item: Callable[[int], object]) -> None:
        """The groups of `state_dict` in flight again; `item(index)`: the dataset item."""
        self.groups = []
        for index, born, lengths, tokens, logprobs, done in groups:  # (n checked by restore)
            it = item(index)
            ends = torch.cumsum(lengths, 0).tolist()
            rows = []
            for k, end in enumerate(ends):
                start = end - int(lengths[k])
                rows.append(Row(list(it.prompt_ids), tokens[start:end].tolist(),
                                logprobs[start:end].tolist(), bool(done[k])))
            self.groups.append(Group(it, born, rows))

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
             anywhere: Optional[Callable[[bool], bool]] = None, take: Optional[int] = None):
        """Steps 2-4 of the module doc on the in-flight groups (already topped up) ->
        (the groups to train on, oldest first; metrics of this rank). `anywhere(has_rows)`: whether
        any DP rank has rows for a call (None: a single rank); every rank then makes the call.
        `take`: complete groups to return (None: local_groups; a dynamic-sampling round takes its
        prompt batches' worth)."""
        take = self.local_groups if take is None else take
        carried_rows = sum(not r.done for g in self.groups if g.born < step for r in g.rows)
        decode = self._generate(self.groups, gen_rows, self.cap, anywhere)
        complete = [g for g in self.groups if g.complete]
        short = max(take - len(complete), 0)
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
        chosen = ready[:take]
        taken = {id(g) for g in chosen}
        self.groups = [g for g in self.groups if id(g) not in taken]
        metrics = {"partial/carried_rows": float(carried_rows),
                   "partial/carried_groups": float(len(self.groups)),
                   "partial/staleness_max": float(max(step - g.born for g in chosen)),
                   "partial/decode_steps": float(decode),
                   "partial/finished_uncapped_rows": float(finish_rows)}
        return chosen, metrics

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
    """A start-up warning when a step's fresh rows alone (data.prompts_per_step x n per replica)
    fill rollout.max_batch_size: every step's call then runs in chunks, one after another, each
    paying the cap again. (Below the first step's rows, every in-flight group's, only that step
    runs in chunks; `python -m hybridflow.cost` prices the choice.)"""
    fresh = -(-local_groups * n // gen_replicas)
    if fresh < max_batch_size:
        return None
    first = -(-(local_groups + local_extra) * n // gen_replicas)
    room = min(-(-fresh * 9 // 8 // 64) * 64, first)
    return (f"hybridflow: warning: rollout.partial generates {fresh} fresh rows per call "
            f"(data.prompts_per_step x rollout.n={n} per generation replica) plus the carried "
            f"ones, in chunks of rollout.max_batch_size={max_batch_size}, one after another, each "
            f"paying the cap again; set rollout.max_batch_size to about {room} (room for the "
            f"carried rows) where memory allows, or {first} (every in-flight group's rows: the "
            f"first step in one call too)")


def deal(saved: list, *, dp_size: int, dp_rank: int) -> dict:
    """This DP rank's share of the in-flight state saved per DP rank (`saved`: one
    {"groups": PartialRollouts.state_dict(), "queue": [dataset index, ...]} per rank). At the
    saved DP size each rank gets its own back; at another, the groups of every rank, oldest first
    (then by saved rank), go to the ranks in turn, and the queued prompts likewise."""
    if len(saved) == dp_size:
        return saved[dp_rank]
    order = sorted(((g[1], r, k) for r, s in enumerate(saved) for k, g in enumerate(s["groups"])))
    groups = [saved[r]["groups"][k] for _, r, k in order]
    queue = [i for s in saved for i in s["queue"]]
    return {"groups": groups[dp_rank::dp_size], "queue": queue[dp_rank::dp_size]}


def gather_state(pr: PartialRollouts, queue: list, group) -> list:
    """Every DP rank's in-flight groups and queued prompts (their dataset indices), in DP order:
    a collective over the DP `group`, for the checkpoint rank 0 writes."""
    mine = {"groups": pr.state_dict(), "queue": [int(it.index) for it in queue]}
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def restore(pr: Optional[PartialRollouts], saved: Optional[list], *, dataset, dp_size: int,
            dp_rank: int, restart_epoch: bool, legacy_count: int = 0) -> tuple[list, Optional[str]]:
    """Put a checkpoint's in-flight state (`gather_state`'s list, None: none saved) back into
    `pr` -> (this rank's queued dataset items, a log line or None). Dropped, with the line saying
    why, when the run has rollout.partial off, the training data changed, or rollout.n did;
    `legacy_count`: groups a checkpoint from before this state was saved counted as in flight."""
    count = sum(len(s["groups"]) + len(s["queue"]) for s in saved or [])
    if not count:
        if legacy_count:
            return [], (f"hybridflow: rollout.partial: {legacy_count} prompt groups in flight (or "
                        f"drawn) on DP rank 0 when the checkpoint was saved were not saved with "
                        f"it (an older hybridflow) and are dropped; their prompts are skipped for "
                        f"the rest of this epoch")
        return [], None
    why = ("rollout.partial.enable=false" if pr is None else
           "the training data changed" if restart_epoch else
           next((f"rollout.n={pr.n} differs from the saved groups' {len(g[2])}"
                 for s in saved for g in s["groups"] if len(g[2]) != pr.n), None))
    if why is not None:
        return [], (f"hybridflow: rollout.partial: {count} prompt groups in flight (or drawn) when "
                    f"the checkpoint was saved are dropped ({why}); their prompts are skipped "
                    f"for the rest of this epoch")
    mine = deal(saved, dp_size=dp_size, dp_rank=dp_rank)
    pr.load_state_dict(mine["groups"], lambda i: dataset[i])
    return [dataset[i] for i in mine["queue"]], None


def row_items(prompts: list) -> list:
    """Stand-in dataset items for RolloutStage.generate over raw rows (n = 1)."""
    return [_RowItem(p) for p in prompts]


@dataclasses.dataclass
class _RowItem:
    prompt_ids: list
    index: int = 0
