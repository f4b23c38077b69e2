"""Summarise a GSM8K run (benchmarks/gsm8k_h200.sh) into benchmarks/results/gsm8k_h200.json and a PNG.

Inputs are the files the device calls wrote: our run's metrics.jsonl (every step, validation rows
included, accumulated across resumed calls), transformers' greedy eval (gsm8k_hf_eval.py JSON) and
TRL's run (trl_gsm8k.py JSON), and optionally our validation of TRL's snapshots (score_snapshots.py
JSON, `--trl-scores`): then `trl.val_accuracy` / `trl.val_accuracy_strict` are those scores, the
same validation as ours. Step times are medians over steps 2.. (step 1 captures CUDA graphs),
leaving out `--exclude-steps` (steps that shared the GPU with another process).

  python benchmarks/gsm8k_report.py --metrics M.jsonl --hf-eval hf_eval.json --trl trl.json \
      [--trl-scores trl_scores.json] [--val-scores val_scores.jsonl --trl-val-scores \
      trl_score_val_scores.jsonl] --exclude-steps 12-16 --out benchmarks/results/gsm8k_h200.json \
      --png benchmarks/results/gsm8k_h200.png --table benchmarks/results/gsm8k_h200.md

`--step-only` summarises a run without validation or peers (`gsm8k_h200.sh step`: the recipe's
step time and stages, run on the machine that measured it, which it records):

  python benchmarks/gsm8k_report.py --step-only --metrics M.jsonl --command "..." --out X.json
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hybridflow

CORE = "val-core/openai/gsm8k/reward/mean@1"
STRICT = "val-aux/openai/gsm8k/gsm8k_strict/mean@1"
STAGES = ("step", "gen", "reshard", "reward", "old_log_prob", "ref", "adv", "update_actor", "val")
SERIES = ("critic/score/mean", "response_length/mean", "response_length/clip_ratio",
          "actor/entropy", "actor/kl_loss", "actor/grad_norm", "training/rollout_probs_diff_mean",
          "training/rollout_probs_diff_max", "rollout_corr/kl", "perf/throughput")


def _steps(spec: str) -> set[int]:
    out = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def summarise(rows: list[dict], *, exclude: set[int]) -> dict:
    train = [r for r in rows if "timing_s/step" in r]
    timed = [r for r in train if r["step"] >= 2 and r["step"] not in exclude]
    med = lambda k: statistics.median(r[k] for r in timed if k in r)  # noqa: E731
    vals = [r for r in rows if CORE in r]
    return {
        "val_summary": val_summary([[r["step"], r[CORE]] for r in vals]),
        "val_accuracy": [[r["step"], r[CORE]] for r in vals],
        "val_accuracy_strict": [[r["step"], r[STRICT]] for r in vals if STRICT in r],
        "ours_step_s": med("timing_s/step"),
        "ours_first_step_s": train[0]["timing_s/step"] if train else None,
        "ours_stages_s": {s: med(f"timing_s/{s}") for s in STAGES
                          if any(f"timing_s/{s}" in r for r in timed)},
        "ours_steps_timed": len(timed),
        "ours_peak_memory_gb": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in train),
        "per_step": {k: [[r["step"], r[k]] for r in train if k in r] for k in SERIES},
        "rollout_training_mismatch_median": {k: med(k) for k in SERIES[6:9]  # return_logprobs
                                             if any(k in r for r in timed)},
        # rollout.partial: carried rows / groups, staleness, decode steps (medians of the timed)
        "partial_median": {k: med(k) for k in sorted({k for r in timed for k in r
                                                       if k.startswith("partial/")})},
        "response_length_max_median": (med("response_length/max")
                                       if any("response_length/max" in r for r in timed) else None),
    }


def val_summary(curve: list[list], last: int = 10) -> dict:
    """The rise over step 0, read three ways: at the best validation, on average over the last
    `last` validations (one greedy pass over 319 problems has a standard error of ~2.5 points, so a
    single best point flatters), and the first step at which the rise reached 10 points."""
    if not curve:
        return {}
    step0 = curve[0][1] if curve[0][0] == 0 else None
    best = max(curve[1:] or curve, key=lambda sa: sa[1])
    tail = [a for _, a in curve[1:][-last:]] or [curve[0][1]]
    out = {"step0": step0, "best": best, f"mean_last_{len(tail)}": statistics.mean(tail)}
    if step0 is not None:
        out["rise_best_points"] = 100 * (best[1] - step0)
        out[f"rise_mean_last_{len(tail)}_points"] = 100 * (statistics.mean(tail) - step0)
        out["first_step_plus_10_points"] = next((s for s, a in curve if a - step0 >= 0.1 - 1e-9),
                                                None)
    return out


def matched(ours: list[list], trl: list[list]) -> list[list]:
    """[step, ours, TRL, ours - TRL in points] at the steps both validated."""
    mine = dict(ours)
    return [[s, mine[s], a, 100 * (mine[s] - a)] for s, a in trl if s in mine]


def paired_by_step(ours_path: str, theirs_path: str, rule: str = "reward") -> list[dict]:
    """Problem by problem at every step both validated (validation.paired_comparison: a = ours,
    b = TRL): discordant counts and McNemar's exact p-value."""
    from hybridflow.validation import paired_comparison

    def by_step(path):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        return {r["step"]: dict(zip(r["index"], r["scores"][rule])) for r in rows}

    ours, theirs = by_step(ours_path), by_step(theirs_path)
    out = []
    for step in sorted(set(ours) & set(theirs)):
        if set(ours[step]) != set(theirs[step]):
            raise ValueError(f"step {step}: {ours_path} and {theirs_path} scored different problems")
        idx = sorted(ours[step])
        out.append({"step": step, **paired_comparison([ours[step][i] for i in idx],
                                                      [theirs[step][i] for i in idx])})
    return out


def table(summary: dict) -> str:
    """Markdown: one row per validation step (val accuracy by both rules; mean training reward,
    response length and entropy over the steps since the previous validation), then the stage
    medians."""
    per = {k: dict(per_step) for k, per_step in summary["per_step"].items()}
    strict = dict(summary["val_accuracy_strict"])

    def avg(key, steps, fmt):
        vals = [per[key][s] for s in steps if s in per[key]]
        return format(statistics.mean(vals), fmt) if vals else ""

    trl = dict(summary.get("trl", {}).get("val_accuracy") or [])
    head = "| step | val math_exact % | val strict (####) % | train reward | response length | entropy |"
    lines = [head + (" TRL val math_exact % |" if trl else ""), "|" + " --- |" * (6 + bool(trl))]
    prev = 0
    for step, acc in summary["val_accuracy"]:
        since = range(prev + 1, step + 1)
        st = f"{100 * strict[step]:.1f}" if step in strict else ""
        tr = (f" {100 * trl[step]:.1f} |" if step in trl else " |") if trl else ""
        lines.append(f"| {step} | {100 * acc:.1f} | {st} | {avg('critic/score/mean', since, '.3f')} "
                     f"| {avg('response_length/mean', since, '.0f')} "
                     f"| {avg('actor/entropy', since, '.3f')} |{tr}")
        prev = step
    lines += ["", "Training columns: means over the steps since the previous validation (samples "
              "at T = 1).", "", "| stage | median s |", "| --- | --- |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in summary["ours_stages_s"].items()]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("val_accuracy", "val math_exact (greedy)"),
                       ("val_accuracy_strict", "val gsm8k_strict (####)")):
        xs, ys = zip(*summary[key]) if summary[key] else ((), ())
        ax[0].plot(xs, ys, marker="o", label=label)
    trl = summary.get("trl", {}).get("val_accuracy")
    if trl:
        xs, ys = zip(*trl)
        ax[0].plot(xs, ys, marker="s", label="TRL val math_exact (greedy)")
    hf = summary.get("transformers_val_accuracy")
    if hf is not None:
        ax[0].axhline(hf, color="gray", ls="--", label="transformers greedy, step 0")
    ax[0].set(xlabel="step", ylabel="accuracy (319 held-out problems)", title="validation")
    ax[0].legend()
    xs, ys = zip(*summary["per_step"]["critic/score/mean"])
    ax[1].plot(xs, ys, label="train reward (math_exact, T=1)")
    ax[1].set(xlabel="step", title="reward")
    ax1b = ax[1].twinx()
    xs, ys = zip(*summary["per_step"]["response_length/mean"])
    ax1b.plot(xs, ys, color="tab:orange", label="mean response length")
    ax1b.set_ylabel("tokens")
    ax[1].legend(loc="upper left")
    ax1b.legend(loc="lower right")
    stages = {k: v for k, v in summary["ours_stages_s"].items() if k not in ("step", "val")}
    ax[2].bar(list(stages), list(stages.values()))
    ax[2].set(ylabel="s (median)", title=f"stages: step {summary['ours_step_s']:.1f} s")
    ax[2].tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def kept_keys(out: str, keep: str) -> dict:
    """The comma-separated `keep` keys of the existing JSON `out` (notes a report does not compute),
    {} when `out` does not exist yet; a key it lacks is an error that lists the keys it has."""
    if not keep or not os.path.exists(out):
        return {}
    old = json.load(open(out))
    missing = [k for k in keep.split(",") if k not in old]
    if missing:
        raise SystemExit(f"--keep: {out} has no key(s) {missing}; it has {sorted(old)}")
    return {k: old[k] for k in keep.split(",")}


def write_step_summary(summary: dict, args) -> None:
    from run_record import machine, versions, write_json  # beside this script

    lengths = [v for _, v in summary["per_step"]["response_length/mean"]]
    out = {k: summary[k] for k in ("ours_step_s", "ours_first_step_s", "ours_stages_s",
                                   "ours_steps_timed", "ours_peak_memory_gb", "partial_median",
                                   "response_length_max_median")}
    out.update(mean_response_length=statistics.mean(lengths) if lengths else None,
               per_step={k: summary["per_step"][k] for k in ("critic/score/mean", "response_length/mean")},
               excluded_steps=sorted(_steps(args.exclude_steps)), command=args.command,
               machine=machine(), versions=versions("megatron-core", "triton"))
    write_json(args.out, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--step-only", action="store_true",
                    help="step times and stages only (no --hf-eval / --trl); records this machine")
    ap.add_argument("--hf-eval", action="append",
                    help="gsm8k_hf_eval.py JSON; repeat for several evals (the first is the one "
                         "compared with step 0: run it on the same machine as the run)")
    ap.add_argument("--trl")
    ap.add_argument("--trl-scores", help="score_snapshots.py JSON: our validation of TRL's snapshots")
    ap.add_argument("--exclude-steps", default="", help="e.g. 12-16: steps that shared the GPU")
    ap.add_argument("--command", default="", help="the run's command, recorded in the JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--png")
    ap.add_argument("--table", help="Markdown table of the val curve, training curves and stages")
    ap.add_argument("--val-scores", help="our run's val_scores.jsonl (every problem's score)")
    ap.add_argument("--trl-val-scores", help="val_scores.jsonl of our validation of TRL's snapshots")
    ap.add_argument("--keep", default="",
                    help="comma-separated keys carried over from the existing --out (e.g. "
                         "earlier_runs,what,raw: notes this script does not compute)")
    args = ap.parse_args()
    if not args.step_only and not (args.hf_eval and args.trl):
        ap.error("--hf-eval and --trl are required (or --step-only)")
    kept = kept_keys(args.out, args.keep)
    rows = [json.loads(line) for line in open(args.metrics)]
    summary = summarise(rows, exclude=_steps(args.exclude_steps))
    if args.step_only:
        write_step_summary(summary, args)
        return
    hfs = [json.load(open(p)) for p in args.hf_eval]
    hf, trl = hfs[0], json.load(open(args.trl))
    summary["transformers_val_accuracy"] = hf["accuracy"]["math_exact"]
    summary["transformers_val_accuracy_strict"] = hf["accuracy"].get("gsm8k_strict")
    summary["transformers_eval"] = {k: hf[k] for k in ("n", "accuracy", "mean_response_length",
                                                       "seconds", "batch_size", "dtype",
                                                       "stop_token_ids", "command") if k in hf}
    if len(hfs) > 1:  # bf16 batched greedy moves with the batch's padding layout: show the spread
        summary["transformers_val_accuracy_runs"] = [
            {"math_exact": h["accuracy"]["math_exact"], "batch_size": h.get("batch_size"),
             "file": p} for h, p in zip(hfs, args.hf_eval)]
    summary["trl"] = {"step_s": trl["step_s"], "step_s_median": trl["step_s_median"],
                      "val_accuracy": trl["val_accuracy"], "config": trl["config"],
                      "peak_memory_gb": trl.get("peak_memory_gb"), "command": trl["command"],
                      "versions": trl["versions"]}
    summary["ours_vs_trl_step_ratio"] = trl["step_s_median"] / summary["ours_step_s"]
    trl_reward = [[r["step"], r["reward"]] for r in trl.get("logs", []) if "reward" in r]
    if trl_reward:  # the training reward of the same step's 512 samples (T = 1), both sides
        pairs = matched(summary["per_step"]["critic/score/mean"], trl_reward)
        summary["train_reward_per_step_vs_trl"] = {
            "steps": pairs, "ours_mean": statistics.mean(p[1] for p in pairs) if pairs else None,
            "trl_mean": statistics.mean(p[2] for p in pairs) if pairs else None}
    if args.trl_scores:
        scores = json.load(open(args.trl_scores))
        summary["trl"].update(val_accuracy=scores["val_accuracy"], val_accuracy_strict=scores["val_accuracy_strict"],
                              val_scored_by="hybridflow's validation of TRL's snapshots (score_snapshots.py)",
                              val_command=scores["command"])
    summary["accuracy_per_step_vs_trl"] = matched(summary["val_accuracy"], summary["trl"]["val_accuracy"])
    if args.val_scores and args.trl_val_scores:
        summary["accuracy_per_step_vs_trl_paired"] = paired_by_step(args.val_scores, args.trl_val_scores)
    summary.update(machine=hf["machine"], versions=hf["versions"], command=args.command,
                   excluded_steps=sorted(_steps(args.exclude_steps)))
    summary.update(kept)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, args.out)
    if args.png:
        plot(summary, args.png)
    if args.table:
        with open(args.table + ".tmp", "w") as f:
            f.write(table(summary))
        os.replace(args.table + ".tmp", args.table)
    print(json.dumps({k: summary[k] for k in ("val_summary", "ours_step_s", "ours_stages_s",
                                              "ours_vs_trl_step_ratio", "transformers_val_accuracy",
                                              "accuracy_per_step_vs_trl",
                                              "accuracy_per_step_vs_trl_paired",
                                              "train_reward_per_step_vs_trl") if k in summary}, indent=1))


if __name__ == "__main__":
    main()
