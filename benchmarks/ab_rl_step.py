"""Before/after timing of one RL step on the same GPU, in one call (issue: the structure rework).

Runs `benchmarks/bench_rl_step.py` of two trees alternately in ABBA order (A B, B A, A B, ...: a
linear drift of the machine over the call, seen on the H200 as +25% from the first run to the
fourth, hits both sides alike), each its own `python -m hybridflow.train`, and writes one JSON with
both sides' per-stage medians and min/max over the later steps of every run, plus the relative
difference of the medians of the run medians.

  git archive e956f27 hybridflow kernels conf benchmarks | (mkdir -p .before && tar -x -C .before)
  python benchmarks/ab_rl_step.py --before .before --out benchmarks/results/structure_ab_h200.json

Each round is `--algos` (GRPO and PPO by default) for `--steps` steps; `--rounds` rounds per side
(an even number keeps the order balanced).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "step"]


def bench(tree: str, algos: str, steps: int, out: str, extra: list[str]) -> dict:
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "bench_rl_step.py"), "--algos", algos,
           "--steps", str(steps), "--out", out, *extra]
    subprocess.run(cmd, check=True, cwd=tree)
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="tree of the earlier commit (git archive)")
    ap.add_argument("--algos", default="grpo,ppo")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("extra", nargs="*", help="arguments passed to both bench_rl_step.py runs")
    args = ap.parse_args()
    sides = {"before": os.path.abspath(args.before), "after": ROOT}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    run_order: list[str] = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
            for side, tree in order:
                out = os.path.join(work, f"{side}{r}.json")
                runs[side].append(bench(tree, args.algos, args.steps, out, args.extra))
                run_order.append(side)
    table = {}
    for algo in args.algos.split(","):
        table[algo] = {}
        for stage in STAGES:
            key = f"timing_s/{stage}"
            per_side = {}
            for side in sides:
                meds = [r["results"][algo]["median_later_steps"].get(key) for r in runs[side]]
                if None in meds:
                    break
                spans = [r["results"][algo]["min_max_later_steps"][key] for r in runs[side]]
                per_side[side] = {"median_of_runs": statistics.median(meds), "run_medians": meds,
                                  "min": min(s[0] for s in spans), "max": max(s[1] for s in spans)}
            if len(per_side) == 2:
                b, a = per_side["before"]["median_of_runs"], per_side["after"]["median_of_runs"]
                per_side["after_vs_before"] = (a - b) / b if b else None
                table[algo][stage] = per_side
    first = runs["after"][0]
    import torch  # noqa: E402 (only for the record)

    record = {"benchmark": "RL step before/after (same machine, alternating runs)",
              "before": os.path.relpath(sides["before"], ROOT), "after": "working tree",
              "machine": first.get("machine"), "versions": first.get("versions"),
              "torch": torch.__version__, "command": " ".join(["python"] + sys.argv),
              "run_order": run_order, "stages": table, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(f"{'algo':6s}{'stage':15s}{'before':>10s}{'after':>10s}{'diff':>8s}   before[min,max]  after[min,max]")
    for algo, stages in table.items():
        for stage, s in stages.items():
            print(f"{algo:6s}{stage:15s}{s['before']['median_of_runs']:10.3f}"
                  f"{s['after']['median_of_runs']:10.3f}{100 * s['after_vs_before']:7.1f}%   "
                  f"[{s['before']['min']:.3f},{s['before']['max']:.3f}]  "
                  f"[{s['after']['min']:.3f},{s['after']['max']:.3f}]")


if __name__ == "__main__":
    main()
