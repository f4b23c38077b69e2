r"""The packed passes' time per token on each side of a multiple of their token budgets.

A token-budget pass runs ceil-ish(tokens / budget) packed micro-batches; a step a few rows past k
budgets runs one micro-batch more, holding those rows under sorted next-fit
(hybridflow/data/microbatch.py; algo.balance_micro_batches deals the rows evenly instead). This
reads runs' metrics.jsonl (timing_s/ref, timing_s/update_actor, perf/total_num_tokens per step;
validation steps and step 1 left out) and reports, per run, the median seconds per 200k tokens of
each pass for the steps within --window tokens below and above each boundary k x budget that the
steps straddle: what the extra micro-batch costs beyond its rows' work. CPU only; no GPU needed.

  python benchmarks/pass_boundaries.py --runs benchmarks/results/gsm8k_speed_h200/base \
      benchmarks/results/gsm8k_embedding_ab_h100/call*/* --out /tmp/boundaries.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, write_json  # noqa: E402

PASSES = {"ref": ("timing_s/ref", 40960), "update_actor": ("timing_s/update_actor", 20480)}
PER = 200_000  # tokens the times are scaled to


def steps_of(path: str) -> list[dict]:
    """The timed training steps of a run (a metrics.jsonl or the folder holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 2 and "perf/total_num_tokens" in r
            and not r.get("timing_s/val")]


def boundaries(steps: list[dict], budget: int, window: int) -> list[int]:
    """The multiples of `budget` with steps on both sides within `window` tokens."""
    tokens = [s["perf/total_num_tokens"] for s in steps]
    if not tokens:
        return []
    ks = range(int(min(tokens) // budget), int(max(tokens) // budget) + 2)
    return [k * budget for k in ks
            if any(k * budget - window <= t < k * budget for t in tokens)
            and any(k * budget <= t < k * budget + window for t in tokens)]


def per_200k(steps: list[dict], key: str):
    """Median seconds of `key` per PER step tokens over the steps that have both (None: none)."""
    xs = [s[key] / s["perf/total_num_tokens"] * PER for s in steps
          if key in s and s.get("perf/total_num_tokens")]
    return statistics.median(xs) if xs else None


def sides(steps: list[dict], key: str, edge: int, window: int) -> dict:
    """{below, above}: steps and median seconds per PER tokens of `key` on each side of `edge`."""
    out = {}
    for name, lo, hi in (("below", edge - window, edge), ("above", edge, edge + window)):
        side = [s for s in steps if key in s and lo <= s["perf/total_num_tokens"] < hi]
        m = per_200k(side, key)
        out[name] = {"steps": len(side), "s_per_200k": round(m, 4) if m is not None else None}
    if out["below"]["s_per_200k"] and out["above"]["s_per_200k"]:
        out["above_over_below"] = round(out["above"]["s_per_200k"] / out["below"]["s_per_200k"], 4)
    return out


def analyse(path: str, *, budgets: dict, window: int) -> dict:
    steps = steps_of(path)
    res = {"steps": len(steps)}
    for name, (key, budget) in budgets.items():
        res[name] = {str(edge): sides(steps, key, edge, window)
                     for edge in boundaries(steps, budget, window)}
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True,
                    help="run folders (holding metrics.jsonl) or metrics.jsonl files")
    ap.add_argument("--ref-budget", type=int, default=PASSES["ref"][1],
                    help="the forward passes' token budget (algo.forward_max_tokens_...)")
    ap.add_argument("--update-budget", type=int, default=PASSES["update_actor"][1],
                    help="the update's token budget (algo.max_tokens_per_micro_batch_per_gpu)")
    ap.add_argument("--window", type=int, default=20_000,
                    help="tokens on each side of a boundary that count")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    budgets = {"ref": (PASSES["ref"][0], a.ref_budget),
               "update_actor": (PASSES["update_actor"][0], a.update_budget)}
    runs = {}
    for path in a.runs:
        try:
            runs[path] = analyse(path, budgets=budgets, window=a.window)
        except FileNotFoundError as e:
            raise SystemExit(f"--runs {path}: no metrics.jsonl there ({e})")
    out = {"benchmark": "packed passes per token on each side of k x their token budgets",
           "command": command(), "budgets": {k: v[1] for k, v in budgets.items()},
           "window_tokens": a.window, "runs": runs}
    write_json(a.out, out)
    for path, r in runs.items():
        for name in budgets:
            for edge, s in r[name].items():
                print(f"{path[-60:]:60s} {name:12s} {edge:>7s}  below {s['below']['steps']:3d} "
                      f"{s['below']['s_per_200k']}  above {s['above']['steps']:3d} "
                      f"{s['above']['s_per_200k']}  x{s.get('above_over_below')}")
    return out


if __name__ == "__main__":
    main()
