"""Validation during training (verl's `trainer.test_freq`): greedy decoding over the held-out prompts.

Every `trainer.val_every` steps (and at step 0 with `trainer.val_before_train`) the actor generates
one greedy response (temperature 0) per prompt of `data.val_files`, in the generation layout, through
the same rollout stage as training (reshard, batched generation, gen-replica split). Each DP replica
takes every DP-th prompt. The responses are scored with the training rule `reward.fn` and every rule
of `reward.val_fns`; per data source, the means over the whole val set are reported with verl's
names: `val-core/<data_source>/reward/mean@1` for `reward.fn`, `val-aux/<data_source>/<fn>/mean@1`
for the others, plus `val-aux/response_length/{mean,max,clip_ratio}`. Rank 0 appends the first
`trainer.val_log_generations` of its rows to `<output_dir>/val_generations.jsonl`, and one line per
validation to `<output_dir>/val_scores.jsonl`: every prompt's score by every rule, in dataset-index
order (`{"step", "index": [...], "scores": {rule: [...]}}`), so that two runs (or a run and a peer's
snapshot scored the same way) can be compared problem by problem (`paired_comparison`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
import torch.distributed as dist

from hybridflow.config import Config
from hybridflow.parallel.context import ParallelContext
from hybridflow.reward import get_reward_fn


class Validator:
    def __init__(self, cfg: Config, ctx: ParallelContext, *, rollout, dataset):
        self.cfg, self.ctx, self.rollout, self.dataset = cfg, ctx, rollout, dataset
        t = cfg.trainer
        r = cfg.rollout
        self.gen_cfg = dataclasses.replace(
            r, n=1, temperature=0.0, top_k=0, top_p=1.0, ignore_eos=False, return_logprobs=False,
            max_new_tokens=t.val_max_new_tokens or r.max_new_tokens,
            quantization=r.quantization if t.val_quantized else "none",
            kv_cache_dtype=r.kv_cache_dtype if t.val_quantized else "auto")
        self.rules = {}
        if cfg.reward.fn is not None:
            self.rules["reward"] = get_reward_fn(cfg.reward.fn)
        for name in cfg.reward.val_fns:
            self.rules[name] = get_reward_fn(name)
        # this DP replica's share: every DP-th prompt (the last shares may be one shorter)
        self.items = [dataset[i] for i in range(ctx.train.dp, len(dataset), ctx.dp_size)]

    def due(self, step: int) -> bool:
        t = self.cfg.trainer
        if step == 0:
            return t.val_before_train
        return t.val_every > 0 and (step % t.val_every == 0 or step == t.total_steps)

    @torch.no_grad()
    def run(self, *, step: int, timer) -> dict:
        batch = self.rollout.generate(self.items, step=step, timer=timer,
                                      rollout_cfg=self.gen_cfg, seed=self.cfg.trainer.seed,
                                      record_experts=False, step_metrics=False)
        scores = {name: self.rollout.rule_scores(self.items, batch, fn=fn)[0]
                  for name, fn in self.rules.items()}
        lengths = batch.response_mask.sum(1)
        lengths_stats = [float(lengths.sum()), float(lengths.max()),
                         float((lengths >= self.gen_cfg.max_new_tokens).sum()), float(len(self.items))]
        per_prompt = [(it.index, it.data_source or "unknown",
                       [float(scores[name][i]) for name in self.rules])
                      for i, it in enumerate(self.items)]
        # one gather: (length stats, per-prompt scores) per replica; per-source means follow
        parts = [None] * self.ctx.dp_size
        dist.all_gather_object(parts, (lengths_stats, per_prompt), group=self.ctx.dp_group)
        rows = sorted(row for _, mine in parts for row in mine)  # every prompt, index order
        totals: dict[str, list[float]] = {}  # per data source: [sum per rule..., count]
        for _, source, vals in rows:
            acc = totals.setdefault(source, [0.0] * (len(self.rules) + 1))
            for k, v in enumerate(vals):
                acc[k] += v
            acc[-1] += 1
        s = torch.tensor([st for st, _ in parts], dtype=torch.float64)  # (DP, 4)
        n = float(s[:, 3].sum())
        metrics = {"val-aux/response_length/mean": float(s[:, 0].sum()) / n,
                   "val-aux/response_length/max": float(s[:, 1].max()),
                   "val-aux/response_length/clip_ratio": float(s[:, 2].sum()) / n,
                   # 1: generated with rollout.quantization or kv_cache_dtype
                   # (trainer.val_quantized), 0: unquantized
                   "val-aux/quantized": float(self.gen_cfg.quantization != "none"
                                              or self.gen_cfg.kv_cache_dtype != "auto")}
        for source, acc in sorted(totals.items()):
            for k, name in enumerate(self.rules):
                group = "val-core" if name == "reward" else "val-aux"
                metrics[f"{group}/{source}/{name}/mean@1"] = acc[k] / acc[-1]
        if self.ctx.rank == 0:
            self._log_generations(step, batch, scores)
            self._log_scores(step, rows)
        return metrics

    def _log_scores(self, step: int, rows: list) -> None:
        record = {"step": step, "index": [i for i, _, _ in rows],
                  "scores": {name: [v[k] for _, _, v in rows] for k, name in enumerate(self.rules)}}
        self._append("val_scores.jsonl", [json.dumps(record)])

    def _append(self, name: str, lines: list[str]) -> None:
        out = self.cfg.trainer.output_dir
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "a") as f:
            f.write("\n".join(lines) + "\n")  # one write per validation

    def _log_generations(self, step: int, batch, scores: dict) -> None:
        count = min(self.cfg.trainer.val_log_generations, len(self.items))
        if count <= 0:
            return
        tok = self.rollout.tok
        lines = []
        for i in range(count):
            it, n = self.items[i], int(batch.response_mask[i].sum())
            row = {"step": step, "index": it.index, "data_source": it.data_source,
                   "prompt": it.prompt_text, "response": tok.decode(batch.response_ids[i, :n].tolist()),
                   "ground_truth": it.ground_truth}
            row.update({f"score/{name}": float(v[i]) for name, v in scores.items()})
            lines.append(json.dumps(row, ensure_ascii=False))
        self._append("val_generations.jsonl", lines)


def paired_comparison(a: list[float], b: list[float]) -> dict:
    """Two greedy validations of the same prompts (0/1 scores, same order): accuracies, the
    discordant counts (a right and b wrong, and the reverse) and McNemar's exact two-sided p-value,
    the chance of a split at least this uneven of the discordant problems if a and b were equally
    good. Paired, it resolves smaller differences than comparing the two accuracies alone."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_comparison needs two equally long, non-empty score lists "
                         f"(got {len(a)} and {len(b)})")
    only_a = sum(1 for x, y in zip(a, b) if x > 0.5 >= y)
    only_b = sum(1 for x, y in zip(a, b) if y > 0.5 >= x)
    n, k = only_a + only_b, min(only_a, only_b)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"n": len(a), "accuracy_a": sum(x > 0.5 for x in a) / len(a),
            "accuracy_b": sum(y > 0.5 for y in b) / len(b), "only_a": only_a, "only_b": only_b,
            "mcnemar_p": p}
