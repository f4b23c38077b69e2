"""The trainer's update and reference passes step by step against the cost model, on CPU, no
device: for each step of a GSM8K run, the shipped fit's prediction at that step's own lengths
(fitted to its statistics, as the records are) beside the measured stage.

    python benchmarks/update_per_step.py
    python benchmarks/update_per_step.py \
        --run benchmarks/results/gsm8k_speed_h100/base/metrics.jsonl --record gsm8k-grpo-fa4-h100

Reports the median measured / predicted ratio, the correlation over steps, and each one's
slope against the step's tokens: a gap that grows with the step's work (a steeper measured
slope) is not a fixed host cost per step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybridflow.cost import estimate_step_time  # noqa: E402
from varlen_records import lengths  # noqa: E402  (the records' fit of a step's statistics)

RECORDS = "benchmarks/results/cost/varlen_gsm8k.json"
FIXED = ("response_lengths", "model", "gpu", "num_gpus", "layout")


def per_step(run: str, record: str) -> dict:
    rec = next(x for x in json.load(open(os.path.join(ROOT, RECORDS)))["records"]
               if x["name"] == record)
    c = rec["config"]
    work = {k: v for k, v in c.items() if k not in FIXED}
    rows = [json.loads(line) for line in open(os.path.join(ROOT, run)) if line.strip()]
    rows = [r for r in rows if "timing_s/update_actor" in r][1:]  # the first step compiles
    out = {"update_actor": ([], []), "ref": ([], [])}
    tokens = []
    for r in rows:
        shape = {"clip_ratio": r["response_length/clip_ratio"], "min": r["response_length/min"]}
        step = {**work, "response_lengths": lengths(r["response_length/mean"], shape, 512),
                "prompt_len": round(r["prompt_length/mean"]),
                "prompt_len_max": round(r["prompt_length/max"])}
        t = estimate_step_time(model=c["model"], gpu=c["gpu"], num_gpus=c["num_gpus"],
                               layout=c["layout"], **step)
        for stage, (meas, pred) in out.items():
            meas.append(r[f"timing_s/{stage}"])
            pred.append(t[stage])
        tokens.append(r["perf/total_num_tokens"])
    tok = np.array(tokens, dtype=float)
    summary = {}
    for stage, (meas, pred) in out.items():
        m, p = np.array(meas), np.array(pred)
        summary[stage] = {
            "measured_median_s": round(float(np.median(m)), 4),
            "predicted_median_s": round(float(np.median(p)), 4),
            "median_ratio": round(float(np.median(m / p)), 4),
            "correlation": round(float(np.corrcoef(m, p)[0, 1]), 3),
            "measured_s_per_token": float(np.polyfit(tok, m, 1)[0]),
            "predicted_s_per_token": float(np.polyfit(tok, p, 1)[0]),
            "residual_s_percentiles": {str(q): round(float(v), 4) for q, v in
                                       zip((10, 25, 50, 75, 90),
                                           np.percentile(m - p, [10, 25, 50, 75, 90]))}}
    return {"run": run, "record": record, "steps": len(rows),
            "tokens_range": [int(tok.min()), int(tok.max())], "stages": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="benchmarks/results/gsm8k_speed_h200/base/metrics.jsonl")
    ap.add_argument("--record", default="gsm8k-grpo-fa4-h200",
                    help="the varlen_gsm8k.json record whose config the run had")
    ap.add_argument("--out", default=None, help="also write the result as JSON")
    a = ap.parse_args(argv)
    res = per_step(a.run, a.record)
    res["command"] = "python benchmarks/update_per_step.py " + " ".join(argv or sys.argv[1:])
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        from hybridflow.atomic import atomic_write

        atomic_write(a.out, lambda p: open(p, "w").write(text + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
