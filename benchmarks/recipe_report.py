"""A recipe's GSM8K run (DAPO, GSPO, Dr.GRPO: benchmarks/gsm8k_h200.sh train ... algo=NAME) beside
the GRPO run, as JSON.

Inputs are metrics.jsonl files the device calls wrote:
- `--metrics`: the recipe's run; `--baseline`: the GRPO run it is compared with (validation at the
  same steps; both from step 0 on the same weights and data);
- `--probe` (optional): a short GRPO run of the SAME code on the same machine, in the same call (validation
  off), so the recipe's step time and its generation overhead are read against a like-for-like
  GRPO step (the baseline run may predate later speed changes);
- `--versions-from` (optional): a results JSON whose `machine` / `versions` describe the device image.

Reported: the validation curve of both runs at their common steps and the difference in points;
the steps' wall time to reach each validation (time to accuracy); stage medians (steps 2.., as
gsm8k_report.py reads them); dynamic sampling: rounds, prompt batches and kept fraction per step,
generation seconds per (rounds, batches) kind, prompts generated per prompt trained, and generation's
overhead over the GRPO step; the rollout/training log-prob mismatch medians of both runs.

  python benchmarks/recipe_report.py --recipe dapo --metrics D/metrics.jsonl \
      --baseline G/metrics.jsonl --probe P/metrics.jsonl \
      --versions-from benchmarks/results/gsm8k_h200.json --command "..." \
      --out benchmarks/results/gsm8k_dapo_h200.json
"""

import argparse
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gsm8k_report import CORE, kept_keys, summarise, val_summary  # noqa: E402

DS = "dynamic_sampling/"


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _train(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "timing_s/step" in r]


def time_to_step(rows: list[dict]) -> dict:
    """step -> seconds of training steps 1..step (validation time left out: both runs validate the
    same problems at the same steps)."""
    out, total = {}, 0.0
    for r in sorted(_train(rows), key=lambda r: r["step"]):
        total += r["timing_s/step"]
        out[r["step"]] = total
    return out


def dynamic_sampling(rows: list[dict], *, gen_baseline_s: float = None) -> dict:
    """Per-step rounds/batches/kept fraction and generation time grouped by (rounds, batches)."""
    steps = [r for r in _train(rows) if DS + "rounds" in r]
    if not steps:
        return {}
    timed = [r for r in steps if r["step"] >= 2]  # step 1 captures the decode graphs
    kinds = {}
    for key, group in itertools.groupby(
            sorted(timed, key=lambda r: (r[DS + "rounds"], r[DS + "batches"])),
            key=lambda r: (int(r[DS + "rounds"]), int(r[DS + "batches"]))):
        group = list(group)
        kinds[f"rounds={key[0]} batches={key[1]}"] = {
            "steps": len(group), "gen_s_median": statistics.median(r["timing_s/gen"] for r in group)}
    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    out = {
        "rounds_median": med(DS + "rounds"), "rounds_max": max(r[DS + "rounds"] for r in steps),
        "batches_mean": statistics.mean(r[DS + "batches"] for r in timed),
        "kept_fraction_median": med(DS + "kept_fraction"),
        "cap_hit_steps": sum(1 for r in steps if r.get(DS + "cap_hit", 0) > 0),
        "gen_s_median": med("timing_s/gen"),
        "gen_s_by_kind": kinds,
        # each batch is one step's worth of prompts: how many were generated per one trained
        "prompts_generated_per_prompt_trained": statistics.mean(r[DS + "batches"] for r in timed),
        "steps_timed": len(timed),
    }
    if gen_baseline_s:
        out["grpo_gen_s_median"] = gen_baseline_s
        out["gen_overhead_x"] = out["gen_s_median"] / gen_baseline_s
    return out


def compare(recipe_rows, baseline_rows, probe_rows=None) -> dict:
    rec, base = summarise(recipe_rows, exclude=set()), summarise(baseline_rows, exclude=set())
    probe = summarise(probe_rows, exclude=set()) if probe_rows else None
    ref = probe or base  # the like-for-like GRPO step when there is one
    base_val = dict(base["val_accuracy"])
    common = [[s, a, base_val[s], 100 * (a - base_val[s])] for s, a in rec["val_accuracy"]
              if s in base_val]
    last = common[-1][0] if common else 0
    t_rec, t_base = time_to_step(recipe_rows), time_to_step(baseline_rows)
    out = {
        "val_accuracy": rec["val_accuracy"],
        "val_accuracy_strict": rec["val_accuracy_strict"],
        "val_vs_grpo_same_steps": common,  # [step, recipe, GRPO, difference in points]
        "val_summary": val_summary([[s, a] for s, a, _, _ in common]),
        "grpo_val_summary_same_steps": val_summary([[s, g] for s, _, g, _ in common]),
        "mean_diff_points_after_step0": (statistics.mean(d for s, _, _, d in common if s > 0)
                                         if len(common) > 1 else None),
        "train_seconds_to_step": {str(s): [t_rec.get(s), t_base.get(s)]
                                  for s, *_ in common if s > 0},  # [recipe, GRPO]
        "step_s": rec["ours_step_s"], "stages_s": rec["ours_stages_s"],
        "peak_memory_gb": rec["ours_peak_memory_gb"],
        "grpo_step_s": ref["ours_step_s"], "grpo_stages_s": ref["ours_stages_s"],
        "grpo_peak_memory_gb": ref["ours_peak_memory_gb"],
        "grpo_timing_source": "probe (same code, same machine)" if probe else "baseline run",
        "step_overhead_x": rec["ours_step_s"] / ref["ours_step_s"],
        "dynamic_sampling": dynamic_sampling(recipe_rows,
                                             gen_baseline_s=ref["ours_stages_s"].get("gen")),
        "rollout_training_mismatch_median": rec["rollout_training_mismatch_median"],
        "grpo_rollout_training_mismatch_median": ref["rollout_training_mismatch_median"],
        "per_step": rec["per_step"],
        "compared_through_step": last,
    }
    if probe:
        out["grpo_baseline_run_step_s"] = base["ours_step_s"]
        out["grpo_baseline_run_stages_s"] = base["ours_stages_s"]
        out["grpo_baseline_run_peak_memory_gb"] = base["ours_peak_memory_gb"]
    for r in recipe_rows:
        if CORE in r and r["step"] not in base_val:
            out.setdefault("val_steps_without_grpo_counterpart", []).append(r["step"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True, help="the algo group's name, e.g. dapo")
    ap.add_argument("--metrics", required=True, help="the recipe run's metrics.jsonl")
    ap.add_argument("--baseline", required=True, help="the GRPO run's metrics.jsonl")
    ap.add_argument("--probe", help="a short GRPO run's metrics.jsonl (same code and machine)")
    ap.add_argument("--versions-from", help="results JSON whose machine/versions keys to record")
    ap.add_argument("--command", default="", help="the recipe run's command")
    ap.add_argument("--probe-command", default="")
    ap.add_argument("--keep", default="", help="comma-separated keys carried over from --out")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kept = kept_keys(args.out, args.keep)
    summary = {"benchmark": f"{args.recipe} on GSM8K beside the GRPO run",
               "recipe": args.recipe, "command": args.command, "probe_command": args.probe_command,
               **compare(_rows(args.metrics), _rows(args.baseline),
                         _rows(args.probe) if args.probe else None)}
    if args.versions_from:
        ref = json.load(open(args.versions_from))
        summary.update(machine=ref.get("machine"), versions=ref.get("versions"))
    summary.update(kept)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, args.out)
    show = ("val_vs_grpo_same_steps", "mean_diff_points_after_step0", "step_s", "grpo_step_s",
            "step_overhead_x", "dynamic_sampling", "rollout_training_mismatch_median")
    print(json.dumps({k: summary[k] for k in show}, indent=1))


if __name__ == "__main__":
    main()
