r"""What one decode step costs in the GSM8K runs, plain and speculative, from the runs' own files
(CPU, no device): each step's plain decode schedule rebuilt from its 512 response lengths as the
generator runs it (stop polls every 16 steps reading the count one poll old, compaction into the
graph buckets, the tail from the first poll with at most `max_rows` rows live: the cost model's
hybridflow/cost/varlen.py schedule), its measured tail steps (`rollout/spec_steps`), and
`timing_s/gen` fitted by least squares over every step of every run:

    gen = a * plain steps + b * plain bucket row-steps + sum_v c_v * tail steps of variant v + d

(v: the tail's rows x drafts). A tail step's cost against a plain step's says how much of it is
the tail's wider forward (it would grow with rows x (1 + drafts)) and how much a fixed cost per
step (the host's round trip for the next drafts); with standard errors, since the runs' samples
differ and the regressors move together.

    python benchmarks/decode_step_costs.py --out benchmarks/results/decode_step_costs_h100.json
    python benchmarks/decode_step_costs.py --run DIR:ROWS:DRAFTS[:TAG] ...   # other runs

A run DIR holds metrics.jsonl and rollout_lengths.jsonl (gsm8k_h200.sh step / ab writes both);
ROWS and DRAFTS are its rollout.speculative.max_rows and draft_tokens; TAG (optional) keeps a
variant of the same tail apart (e.g. `advance` for rollout.speculative.fused_advance), so its tail
step gets a coefficient of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.run_record import command, versions, write_json  # noqa: E402
from hybridflow.cost.varlen import _chunk  # noqa: E402

R = "benchmarks/results/"
# the recipe's runs at today's code on one H100, each with its per-step lengths
RUNS = [f"{R}gsm8k_spec_tail_h100/call1/base:16:4", f"{R}gsm8k_spec_tail_h100/call2/base:16:4",
        f"{R}gsm8k_spec_tail_h100/call2/spec_d8:16:8",
        f"{R}gsm8k_spec_tail_h100/call2/spec_r32:32:4",
        f"{R}gsm8k_spec_tail_h100/call2/spec_r32_d8:32:8",
        f"{R}gpu_monitor_h100/ab/base:16:4", f"{R}gpu_monitor_h100/ab/nomonitor:16:4",
        f"{R}gpu_monitor_h100/ab2/base:16:4", f"{R}gpu_monitor_h100/ab2/nomonitor:16:4"]
CAP, MAX_BATCH, WINDOW, PROMPT = 1024, 512, 256, 256  # the recipe's rollout


def plain_schedule(lengths, max_rows: int) -> tuple[int, float]:
    """(plain decode steps, their bucket row-steps) of one generate call of `lengths` before the
    speculative tail takes over (all of it when it never does)."""
    d = _chunk(np.asarray(lengths, dtype=np.int64), prompt=PROMPT, cap=CAP, max_batch=MAX_BATCH,
               compact=True, window=WINDOW, exact_end=False, wide_rows=MAX_BATCH + 1,
               own_prompt=None, spec=(max_rows, 4, 2.0))
    return d.steps - d.spec_steps, d.row_steps - d.spec_row_steps


def step_rows(run: str) -> list[dict]:
    """One row per timed step of `run` ("DIR:ROWS:DRAFTS[:TAG]"): steps 2.. without validation."""
    path, rows, drafts, *tag = run.split(":")
    if len(tag) > 1:
        raise SystemExit(f"--run {run!r}: expected DIR:ROWS:DRAFTS[:TAG]")
    variant = f"tail{rows}x{drafts}" + "".join(f"_{t}" for t in tag)
    metrics = {}
    with open(os.path.join(ROOT, path, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line) if line.strip() else {}
            if "timing_s/gen" in r and "timing_s/val" not in r and r["step"] >= 2:
                metrics[r["step"]] = r
    out = []
    with open(os.path.join(ROOT, path, "rollout_lengths.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            m = metrics.get(r["step"])
            if m is None:
                continue
            plain, row_steps = plain_schedule(r["response_lengths"], int(rows))
            out.append({"run": path.removeprefix(R), "step": r["step"], "variant":
                        variant, "plain_steps": plain, "row_steps": row_steps,
                        "tail_steps": m.get("rollout/spec_steps", 0), "gen_s": m["timing_s/gen"]})
    return out


def fit(rows: list[dict]) -> dict:
    """Least squares of gen_s on plain steps, plain bucket row-steps (per 1,000), each variant's
    tail steps and a constant; coefficients in ms with OLS standard errors."""
    variants = sorted({r["variant"] for r in rows})
    names = ["plain_step", "per_1000_bucket_row_steps", *(f"{v}_step" for v in variants), "const"]
    x = np.array([[r["plain_steps"], r["row_steps"] / 1e3,
                   *(r["tail_steps"] * (r["variant"] == v) for v in variants), 1.0] for r in rows])
    y = np.array([r["gen_s"] for r in rows])
    if len(y) <= x.shape[1]:
        raise SystemExit(f"{len(y)} steps for {x.shape[1]} coefficients: give more runs (--run)")
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    sigma2 = float(resid @ resid) / (len(y) - x.shape[1])
    se = np.sqrt(np.diag(sigma2 * np.linalg.pinv(x.T @ x)))
    return {"steps": len(y), "rms_ms": float(np.sqrt(np.mean(resid ** 2))) * 1e3,
            "coef_ms": {n: float(c) * 1e3 for n, c in zip(names, coef)},
            "stderr_ms": {n: float(s) * 1e3 for n, s in zip(names, se)},
            "per_variant": {v: {"steps": sum(r["variant"] == v for r in rows),
                                "median_plain_steps": float(np.median(
                                    [r["plain_steps"] for r in rows if r["variant"] == v])),
                                "median_tail_steps": float(np.median(
                                    [r["tail_steps"] for r in rows if r["variant"] == v]))}
                            for v in variants}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs="+", default=RUNS, metavar="DIR:ROWS:DRAFTS[:TAG]")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [r for run in args.run for r in step_rows(run)]
    res = fit(rows)
    for n, c in res["coef_ms"].items():
        print(f"{n:28s} {c:9.3f} ms  +- {res['stderr_ms'][n]:.3f}")
    print(f"{res['steps']} steps, rms {res['rms_ms']:.1f} ms")
    if args.out:
        write_json(args.out, {"benchmark": "decode step costs fitted to the GSM8K runs' "
                                           "generation times (plain and speculative tail)",
                              "command": command(), "versions": versions(), "runs": args.run,
                              **res, "per_step": rows})


if __name__ == "__main__":
    main()
