"""Why the cost model's generation misses the fa4 GSM8K records (grpo_fa4 high, dapo_fa4 low):
the simulated schedule (cost.varlen) beside what the runs measured, on CPU, no device.

    python benchmarks/gen_tail_diagnosis.py

1. Per record: the speculative tail the simulation runs from the record's lengths
   (lengths.fit_stats: log-normal pinned at the cap share) against the run's rollout/spec_* metrics
   (medians over steps 2..N): tail steps, running rows per tail step, tail tokens, and the token
   the tail starts from (measured: cap - spec_steps x spec_tokens_per_row_step, as the tail's rows
   are about the capped ones).
2. The held-out (family left out) generation prediction with the record's lengths and with a
   distribution of the same mean and cap share whose other rows end where the measured tail
   starts (`pinned`, a diagnostic, not a model).
3. DAPO per generation call (512 / 1024 / 1536 rows) measured against held-out and in-sample
   predictions.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics as st
import sys
from statistics import NormalDist

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hybridflow.cost.calibrate import fit, load_records, parse_record  # noqa: E402
from hybridflow.cost.timing import _gen  # noqa: E402
from hybridflow.cost.varlen import _spec_start, decode_schedule, row_lengths  # noqa: E402

CAP, K = 1024, 256
RUNS = {"gsm8k-grpo-fa4-h100": ["gsm8k_speed_h100/base/metrics.jsonl"],
        "gsm8k-grpo-fa4-h200": ["gsm8k_speed_h200/base/metrics.jsonl"],
        "gsm8k-dapo-fa4-h100": ["gsm8k_speed_h100/dapo_metrics.jsonl"]}
DAPO_RUNS = ["gsm8k_speed_h100/dapo_metrics.jsonl",
             "gsm8k_speed_h100/consecutive/dapo_metrics.jsonl"]


def steps_of(path):
    with open(os.path.join(ROOT, "benchmarks/results", path)) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    return [r for r in rows if "timing_s/step" in r][1:]


def pinned(mean, clip, shortest, rows, start, m=16):
    """K lengths: `clip` of them at the cap, the rest a + exp(mu + sigma z) (a = shortest - 1)
    with the body's (1 - (m - capped) / body rows) quantile at `start`, the whole mean `mean`."""
    nd, a = NormalDist(), shortest - 1
    ncap, kc = round(clip * rows), round(clip * K)
    body_mean = (mean * K - kc * CAP) / (K - kc)
    zq = nd.inv_cdf(1 - max(m - ncap, 1) / (rows - ncap))
    grid = [nd.inv_cdf((i + 0.5) / 4000) for i in range(4000)]

    def body(sig, z):
        return [min(CAP - 1, a + math.exp(math.log(start - a) + sig * (zi - zq))) for zi in z]
    lo, hi = 1e-3, 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.mean(body(mid, grid)) > body_mean else (lo, mid)
    pts = body((lo + hi) / 2, [nd.inv_cdf((i + 0.5) / (K - kc)) for i in range(K - kc)])
    return tuple(sorted([max(1, round(v)) for v in pts] + [CAP] * kc))


def tail(w, rows):
    lengths = row_lengths(w, rows)
    d = decode_schedule(w, rows, rows)
    start = _spec_start(np.sort(lengths), CAP, w.spec_rows)
    rest = lengths[lengths > start + 1] - (start + 1)
    live = np.ceil(rest / w.spec_tail_tokens_per_step).sum()
    return d, start, live, rest.sum()


def main():
    cmd = json.load(open(os.path.join(ROOT, "benchmarks/results/cost_validation.json")))
    paths = [os.path.join(ROOT, p) for p in cmd["validation"]["command"].split()
             if p.startswith("benchmarks/results/cost/")]
    records = load_records(paths)
    loo = {f: fit([r for r in records if r.get("family") != f]) for f in ("grpo_fa4", "dapo_fa4")}
    full = fit(records)
    print(f"{'record':<22} {'':<9} {'steps':>6} {'tail from':>9} {'tail steps':>10} "
          f"{'rows/tail step':>14} {'tail tokens':>11} {'gen held out':>12}")
    for rec in (r for r in records if r["name"] in RUNS):
        run, cal = parse_record(rec), loo[rec["family"]]
        w = run.workload
        rows = math.ceil(w.num_sequences * w.gen_prompt_factor / w.gen_rounds)
        s = [r for p in RUNS[rec["name"]] for r in steps_of(p)]
        per_round = [r.get("dynamic_sampling/rounds", 1.0) for r in s]
        m_steps = st.median(r["rollout/spec_steps"] for r in s)
        m_rows = st.median(r["rollout/spec_row_steps"] / r["rollout/spec_steps"] for r in s
                           if r["rollout/spec_steps"])
        m_tok = st.median(r["rollout/spec_tokens"] for r in s)
        m_start = CAP - st.median(r["rollout/spec_steps"] * r["rollout/spec_tokens_per_row_step"]
                                  for r in s)
        print(f"{rec['name']:<22} {'measured':<9} {'-':>6} {m_start:>9.0f} {m_steps:>10.0f} "
              f"{m_rows:>14.1f} {m_tok:>11.0f} {rec['metrics']['timing_s/gen']:>12.3f}"
              + ("  (spec_* per call: averaged over a step's rounds)"
                 if max(per_round) > 1 else ""))
        lg = rec["lengths"]
        variants = [("simulated", w), ("pinned", dataclasses.replace(w, response_lengths=pinned(
            lg["mean"], lg["clip_ratio"], min(lg["min"], lg["mean"]), rows, round(m_start))))]
        for label, ww in variants:
            d, start, live, tok = tail(ww, rows)
            gen = _gen(run.shape, run.gpu, run.plan, ww, cal).seconds(cal.coefs())
            print(f"{'':<22} {label:<9} {d.steps:>6} {start:>9} {d.spec_steps:>10} "
                  f"{live / max(d.spec_steps, 1):>14.1f} {tok:>11.0f} {gen:>12.3f}")
    # DAPO per call
    rec = next(r for r in records if r["name"] == "gsm8k-dapo-fa4-h100")
    run = parse_record(rec)
    pred = {}
    for k in (1, 2, 3):
        wk = dataclasses.replace(run.workload, gen_rounds=1.0, gen_prompt_factor=float(k))
        pred[k] = [_gen(run.shape, run.gpu, run.plan, wk, c).seconds(c.coefs())
                   for c in (loo["dapo_fa4"], full)]
    meas = {}
    for p in DAPO_RUNS:
        for r in steps_of(p):
            meas.setdefault((r["dynamic_sampling/rounds"], r["dynamic_sampling/batches"]),
                            []).append(r["timing_s/gen"])
    print("\nDAPO generation per step by its calls (rows), both H100 DAPO runs, steps 2..N:")
    for key, calls in (((1.0, 2.0), [2]), ((1.0, 3.0), [3]), ((2.0, 3.0), [2, 1])):
        m = meas[key]
        print(f"  {'+'.join(str(512 * c) for c in calls):>9} rows: measured {st.median(m):.3f} "
              f"(n={len(m)})  held out {sum(pred[c][0] for c in calls):.3f}  "
              f"in-sample {sum(pred[c][1] for c in calls):.3f}")
    for name, c in (("held out dapo_fa4", loo["dapo_fa4"]), ("held out grpo_fa4", loo["grpo_fa4"]),
                    ("all records", full)):
        print(f"  fit on {name:<18}: prefill_efficiency {1 / c.coefs()['inv_prefill_eff']:.3f} "
              f"(decode FLOPs too), fused_decode_layer_overhead_s "
              f"{c.coefs()['fused_decode_layer_overhead_s']:.3g}")


if __name__ == "__main__":
    main()
