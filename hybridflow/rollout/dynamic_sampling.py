"""DAPO's dynamic sampling as a stage: generate rounds until the step has enough informative groups.

`fill_informative(next_round, ...)` calls `next_round(k)` (k batches of new prompts -> generate ->
score; each call returns this rank's RolloutBatch with `scores` set, groups of `group_size`
consecutive rows, and that round's reward metrics), keeps the groups whose scores are not all equal
(hybridflow.algo.informative_groups), and stops once the informative groups found on all DP ranks
together reach the target (`num_groups` per rank x DP) or after `max_rounds` rounds.

Round size (k prompt batches of `num_groups` per rank): `batches_per_round` (verl's
data.gen_batch_size / data.train_batch_size; its DAPO recipe generates 3x). A round pays the long
tail of response lengths once whatever its size (more rows cost less than another tail; the decode
buckets set the steps: docs/perf_log.md), so one round of 2 batches costs less than two rounds of
one. With `adaptive`, k is sized from the kept fraction measured so far: `kept_estimate` (the
earlier steps', from the caller) for the first round, this step's for later ones; k = ceil(missing
groups / (fraction x groups per batch)), between 1 and `batches_per_round` (the cap; the cap itself
when nothing is known yet). With `confidence` q as well, a round is sized in prompts rather than
whole batches: the fewest groups that hold the missing ones with probability q when each is
informative with the estimated fraction (a normal approximation of the binomial), so a round is
rarely short by a few groups, which would cost a whole second round; the prompts of a batch not
drawn wait for the next round or step (the sampler keeps its place). Every rank computes the size
from DP-summed counts, so all ranks draw the same number of prompts. Informative groups beyond the
target are dropped (as verl does).

Choices:
- Groups are pooled over DP: every rank runs the same number of rounds (the rounds' collectives
  stay aligned), the kept groups of all ranks are gathered (in rank order, then round order) and
  rank r trains on groups [r * num_groups, (r + 1) * num_groups) of the pool; extra groups are
  dropped. So a rank that drew hard prompts does not hold the others back.
- Cap hit (fewer informative groups than the target after max_rounds): the step still trains, on all
  informative groups found, topped up with uninformative ones so the batch keeps its size (mini- and
  micro-batch sizes, pipeline micro-batches stay valid). Uninformative groups have zero advantage
  under group-baseline estimators, so they add no policy gradient (only tokens to a token-mean
  normaliser and KL/entropy terms). `dynamic_sampling/cap_hit` says it happened. verl raises here
  instead; a long run should not die on one hard batch, and the metric makes it visible.
- Group ids are renumbered to the pooled position (rank r's groups are r * num_groups + j), the
  convention of a batch without dynamic sampling.
Metrics: dynamic_sampling/rounds (generation rounds this step), batches (prompt batches generated:
verl's train/num_gen_batches x its gen/train batch ratio), kept_fraction (informative / generated
groups), cap_hit (0/1), filler_groups (uninformative groups trained on), score_mean (mean score of
ALL generated samples: the policy's score before the filter, which critic/score/mean, taken on the
kept batch, is not).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hybridflow.algo.dapo import informative_groups
from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel.dp import dp_sum, gather_batches


def _sums(values: list[float], group) -> list[float]:
    return values if group is None else [dp_sum(float(v), group=group) for v in values]


def _gather(batch: RolloutBatch, group, pad_id: int) -> list[RolloutBatch]:
    return [batch] if group is None else gather_batches(batch, group=group, pad_id=pad_id)


def _groups(batch: RolloutBatch, group_size: int) -> list[RolloutBatch]:
    return [batch.select(slice(i, i + group_size)) for i in range(0, batch.batch_size, group_size)]


def chunking_warning(*, batches_per_round: int, local_prompts: int, n: int, gen_replicas: int,
                     max_batch_size: int) -> Optional[str]:
    """A start-up warning when a round's rows per generate call exceed rollout.max_batch_size: the
    generator then runs them in chunks one after another, each paying the long tail again, which
    undoes what a larger round buys."""
    rows = math.ceil(batches_per_round * local_prompts * n / gen_replicas)
    if batches_per_round < 2 or rows <= max_batch_size:
        return None
    return (f"hybridflow: warning: a dynamic-sampling round generates up to {rows} rows per call "
            f"(algo.dynamic_sampling.batches_per_round={batches_per_round} x {local_prompts} "
            f"prompts x rollout.n={n}) in chunks of rollout.max_batch_size={max_batch_size}, one "
            f"after another: each chunk pays the long tail of response lengths again; set "
            f"rollout.max_batch_size={rows} where memory allows")


def round_batches(missing: int, target: int, kept_fraction: Optional[float], cap: int) -> int:
    """Prompt batches (`target` groups each, over all ranks) for a round that should find `missing`
    informative groups when a fraction `kept_fraction` of groups is informative; 1..cap."""
    if not kept_fraction or kept_fraction <= 0:
        return cap
    return max(1, min(cap, math.ceil(missing / (kept_fraction * target) - 1e-9)))


def round_prompts(missing: int, *, num_groups: int, dp: int, kept_fraction: Optional[float],
                  cap: int, confidence: float) -> int:
    """Prompts per rank for a round that finds `missing` informative groups (over all `dp` ranks)
    with probability `confidence` when each group is informative with probability `kept_fraction`:
    the fewest n groups with n f - z sqrt(n f (1 - f)) >= missing (z the normal quantile of the
    confidence), over the ranks; 1 .. cap batches of `num_groups` (the cap when nothing is
    known)."""
    most = cap * num_groups
    if not kept_fraction or kept_fraction <= 0:
        return most
    f = min(kept_fraction, 1.0)
    a = NormalDist().inv_cdf(confidence) * math.sqrt(f * (1 - f))
    root = (a + math.sqrt(a * a + 4 * f * missing)) / (2 * f)  # sqrt(n) at equality
    return max(1, min(most, math.ceil(math.ceil(root * root - 1e-9) / dp)))


def fill_informative(next_round: Callable[[int], tuple[RolloutBatch, dict]], *, num_groups: int,
                     group_size: int, max_rounds: int,
                     dp_group: Optional[dist.ProcessGroup] = None,
                     pad_id: int = 0, batches_per_round: int = 1, adaptive: bool = False,
                     kept_estimate: Optional[float] = None,
                     confidence: Optional[float] = None) -> tuple[RolloutBatch, dict]:
    """This rank's `num_groups` groups (see module doc) and the stage's metrics. `next_round(p)`:
    p prompts per rank (k batches: k x num_groups). `dp_group` None: a single process (no
    collectives)."""
    if max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds} must be >= 1")
    if batches_per_round < 1:
        raise ValueError(f"batches_per_round={batches_per_round} must be >= 1")
    dp = 1 if dp_group is None else dist.get_world_size(dp_group)
    rank = 0 if dp_group is None else dist.get_rank(dp_group)
    target = num_groups * dp
    kept, spare, round_metrics = [], [], []
    generated = found = batches = 0
    score_sum = 0.0
    for rounds in range(1, max_rounds + 1):
        prompts = batches_per_round * num_groups
        fraction = found / generated if generated else kept_estimate
        if adaptive and confidence is not None:
            prompts = round_prompts(target - found, num_groups=num_groups, dp=dp,
                                    kept_fraction=fraction, cap=batches_per_round,
                                    confidence=confidence)
        elif adaptive:
            prompts = num_groups * round_batches(target - found, target, fraction,
                                                 batches_per_round)
        batches += prompts / num_groups
        batch, metrics = next_round(prompts)
        round_metrics.append(metrics)
        keep = informative_groups(batch.scores, batch.group_ids)  # (B,)
        kept.append(batch.select(keep))
        spare.append(batch.select(~keep))
        rows, kept_rows, scores = _sums([batch.batch_size, int(keep.sum()),
                                         float(batch.scores.sum())], dp_group)
        generated += round(rows) // group_size
        found += round(kept_rows) // group_size
        score_sum += scores
        if found >= target:
            break
    pool = []
    if found:  # (no empty all-gathers)
        pool = [g for b in _gather(RolloutBatch.cat(kept, pad_id=pad_id), dp_group, pad_id)
                for g in _groups(b, group_size)]
    fillers = max(target - len(pool), 0)
    if fillers:
        pool += [g for b in _gather(RolloutBatch.cat(spare, pad_id=pad_id), dp_group, pad_id)
                 for g in _groups(b, group_size)][:fillers]
    assert len(pool) >= target, "each round generates the target number of groups"
    mine = RolloutBatch.cat(pool[rank * num_groups:(rank + 1) * num_groups], pad_id=pad_id)
    mine.group_ids = (rank * num_groups + torch.arange(num_groups)).repeat_interleave(group_size)
    metrics = {k: sum(m[k] for m in round_metrics) / len(round_metrics) for k in round_metrics[0]}
    metrics.update({"dynamic_sampling/rounds": float(rounds),
                    "dynamic_sampling/batches": float(batches),
                    "dynamic_sampling/kept_fraction": found / max(generated, 1),
                    "dynamic_sampling/cap_hit": float(found < target),
                    "dynamic_sampling/filler_groups": float(fillers),
                    "dynamic_sampling/score_mean": score_sum / max(generated * group_size, 1)})
    return mine, metrics
