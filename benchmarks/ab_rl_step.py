"""A/B of the RL step on one machine: two configurations, or two trees, of bench_rl_step.py alternated.

Each round runs every workload (`--models`) on both sides, each run its own bench_rl_step.py process,
in ABBA order over the rounds (round 1: A B, round 2: B A, ...), so that a linear drift of the machine
over the call (seen on the H200: +25% from the first run to the fourth) hits both sides alike. Per
workload and algorithm the JSON holds `<side>_step_s` for both sides, the median step time over the
later steps of all that side's runs (each run's first step, graph capture and compilation, left
out), the same median per stage, each run's median, and `<b>_vs_<a>` = (B - A) / A of the step.

  # the product's defaults vs the speed configuration (benchmarks/defaults_h200.sh)
  python benchmarks/ab_rl_step.py --sides default speed --b-args=--speed \
      --models w1_0_5b=qwen2_0_5b,w1_1_5b=qwen2_1_5b --rounds 2 --out /tmp/ab.json -- --algos grpo --steps 5
  # a commit before vs this tree, same flags on both sides
  git archive COMMIT hybridflow benchmarks | (mkdir -p .before && tar -x -C .before)
  python benchmarks/ab_rl_step.py --sides before after --a-tree .before --out /tmp/ab.json

`--deadline-s S`: a workload's next round starts only if its previous round's time says it ends
within S seconds of the start (the first round always runs), and no run goes on past S + 60 s;
`--run-timeout-s` ends a run that hangs (counted failed, like a run that exits with an error). Every run's output goes to
`--logdir`/<n>_<workload>_<side>.log; the JSON is rewritten (atomically) after every pair of runs.
"""

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
GRACE_S = 60.0
from run_record import command, write_json  # noqa: E402


def bench(tree: str, args: list[str], *, out: str, log: str, timeout_s: float | None) -> dict:
    """One bench_rl_step.py run of `tree`: its results JSON, or {"failed": exit code, "log": log}
    (exit code "timeout" past `timeout_s`)."""
    import json

    cmd = [sys.executable, os.path.join(tree, "benchmarks", "bench_rl_step.py"), *args, "--out", out]
    with open(log, "w") as f:  # its own process group: a timeout ends the trainer it started too
        proc = subprocess.Popen(cmd, cwd=tree, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    if rc:
        return {"failed": rc, "log": log}
    with open(out) as f:
        return json.load(f)


def pooled(runs: list[dict], algo: str) -> dict:
    """Per stage: the median over the later steps of every run, each run's median, min and max."""
    ok = [r["results"][algo] for r in runs if "results" in r]
    keys = sorted({k for r in ok for s in r["steps"][1:] for k in s if k.startswith("timing_s/")})
    out = {}
    for k in keys:
        later = [s[k] for r in ok for s in r["steps"][1:] if k in s]
        out[k.removeprefix("timing_s/")] = {
            "median": statistics.median(later), "run_medians": [r["median_later_steps"].get(k) for r in ok],
            "min": min(later), "max": max(later), "num_steps": len(later)}
    return out


def summarize(runs: dict, sides: list[str], algos: list[str]) -> dict:
    """{algo: {"<side>_step_s", "<b>_vs_<a>", "stages": {stage: {side: pooled}}}} of one workload."""
    a, b = sides
    out = {}
    for algo in algos:
        per_side = {s: pooled(runs[s], algo) for s in sides}
        entry = {f"{s}_step_s": per_side[s].get("step", {}).get("median") for s in sides}
        if entry[f"{a}_step_s"] and entry[f"{b}_step_s"]:
            entry[f"{b}_vs_{a}"] = (entry[f"{b}_step_s"] - entry[f"{a}_step_s"]) / entry[f"{a}_step_s"]
        stages = sorted(set(per_side[a]) | set(per_side[b]))
        entry["stages"] = {st: {s: per_side[s][st] for s in sides if st in per_side[s]} for st in stages}
        entry["failed_runs"] = {s: sum("failed" in r for r in runs[s]) for s in sides}
        out[algo] = entry
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", nargs=2, default=["a", "b"], metavar=("A", "B"), help="the two sides' names")
    ap.add_argument("--a-args", default="", help="bench_rl_step.py arguments of side A only (one string)")
    ap.add_argument("--b-args", default="", help="... of side B only")
    ap.add_argument("--a-tree", default=ROOT, help="the tree whose bench_rl_step.py side A runs (default this one)")
    ap.add_argument("--b-tree", default=ROOT)
    ap.add_argument("--models", default="",
                    help="workloads NAME=MODEL,... (or MODEL,...), each run with --model MODEL; "
                         "default: one workload, the common arguments' model")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; an even number balances the order")
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--run-timeout-s", type=float, default=None, help="a run past this is ended and counted failed")
    ap.add_argument("--logdir", default=None, help="every run's output (default: a temporary folder)")
    ap.add_argument("--out", required=True)
    ap.add_argument("common", nargs="*", help="bench_rl_step.py arguments of both sides (after --)")
    args = ap.parse_args(argv)
    if args.sides[0] == args.sides[1]:
        raise ValueError(f"--sides {args.sides}: two different names expected")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    a, b = args.sides
    sides = {a: (os.path.abspath(args.a_tree), shlex.split(args.a_args)),
             b: (os.path.abspath(args.b_tree), shlex.split(args.b_args))}
    workloads = {}
    for item in filter(None, args.models.split(",")):
        name, _, model = item.rpartition("=")
        workloads[name or model] = ["--model", model]
    workloads = workloads or {"default": []}
    algos = "grpo,ppo"
    for i, arg in enumerate(args.common):  # bench_rl_step's own default unless given
        if arg == "--algos":
            algos = args.common[i + 1]
    runs = {w: {a: [], b: []} for w in workloads}
    record = {"benchmark": "RL step A/B, alternating runs on one machine", "command": command(),
              "sides": {s: {"tree": os.path.relpath(t, ROOT), "args": x} for s, (t, x) in sides.items()},
              "common_args": args.common, "run_order": [], "workloads": {}}
    logdir = args.logdir or tempfile.mkdtemp(prefix="ab_rl_step_")
    os.makedirs(logdir, exist_ok=True)
    pair_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for w, wargs in workloads.items():
                elapsed = time.perf_counter() - t_start
                if r and args.deadline_s and elapsed + pair_s[w] > args.deadline_s:
                    print(f"{w}: round {r + 1} skipped (its last round took {pair_s[w]:.0f} s, "
                          f"{args.deadline_s - elapsed:.0f} s left)", flush=True)
                    continue
                t0 = time.perf_counter()
                for side in ([a, b] if r % 2 == 0 else [b, a]):
                    tree, extra = sides[side]
                    n = len(record["run_order"])
                    out = os.path.join(work, f"{n}.json")
                    log = os.path.join(logdir, f"{n}_{w}_{side}.log")
                    timeout_s = args.run_timeout_s
                    if args.deadline_s:  # no run outlives the deadline by more than GRACE_S
                        left = args.deadline_s + GRACE_S - (time.perf_counter() - t_start)
                        timeout_s = max(1.0, min(timeout_s or left, left))
                    res = bench(tree, [*args.common, *wargs, *extra], out=out, log=log, timeout_s=timeout_s)
                    runs[w][side].append(res)
                    record["run_order"].append(f"{w}:{side}")
                    status = f"failed (exit {res['failed']}, {log})" if "failed" in res else "done"
                    print(f"round {r + 1} {w} {side}: {status}, {time.perf_counter() - t_start:.0f} s", flush=True)
                    if "machine" in res:
                        record.update(machine=res["machine"], versions=res["versions"])
                pair_s[w] = time.perf_counter() - t0
                for algo, entry in summarize(runs[w], [a, b], algos.split(",")).items():
                    key = w if len(algos.split(",")) == 1 else f"{w}/{algo}"
                    record["workloads"][key] = {**entry, "runs": runs[w]}
                record["wall_s"] = time.perf_counter() - t_start
                write_json(args.out, record)
    print(f"{'workload':16s}{a + ' s':>12s}{b + ' s':>12s}{'B vs A':>9s}   runs")
    for key, e in record["workloads"].items():
        va, vb = e[f"{a}_step_s"], e[f"{b}_step_s"]
        diff = e.get(f"{b}_vs_{a}")
        print(f"{key:16s}{va or float('nan'):12.3f}{vb or float('nan'):12.3f}"
              f"{100 * diff if diff is not None else float('nan'):8.1f}%   "
              f"{len(e['runs'][a])} + {len(e['runs'][b])} (failed {e['failed_runs'][a]} + {e['failed_runs'][b]})")
    return record


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"ab_rl_step.py: error: {e}")
