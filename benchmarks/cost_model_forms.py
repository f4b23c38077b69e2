"""Leave-one-out step-time error of the cost model for several overlap exponents p (timing.OVERLAP_P:
1 = host and GPU time add up, large = only the larger counts), on the H200 records.

    python benchmarks/cost_model_forms.py benchmarks/results/cost/rl_*.json \
        --out benchmarks/results/cost_model_forms.json
"""
import argparse
import json
import sys
from unittest import mock

from hybridflow.cost import calibrate, timing


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    records, out = calibrate.load_records(a.results), []
    print(f"{'p':>5} {'mean |err|':>11} {'max |err|':>10} {'within 15%':>11}   fitted train / forward MFU")
    for p in (1.0, 1.25, 1.5, 2.0, 3.0, 8.0):
        with mock.patch.object(timing, "OVERLAP_P", p):
            rows = calibrate.predict_vs_measured(records)
            fit = calibrate.fit(records)
        errs = [abs(r["error_pct"]) for r in rows if r["metric"] == calibrate.STEP_KEY]
        print(f"{p:>5} {sum(errs) / len(errs):>10.1f}% {max(errs):>9.1f}% {sum(e <= 15 for e in errs):>6} of "
              f"{len(errs)}   {fit.train_mfu:.2f} / {fit.forward_mfu:.2f}")
        out.append({"overlap_p": p, "mean_abs_step_error_pct": sum(errs) / len(errs),
                    "max_abs_step_error_pct": max(errs), "within_15pct": sum(e <= 15 for e in errs),
                    "num_configs": len(errs), "fitted": fit.to_dict()})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "cost model: leave-one-out step error vs overlap exponent p",
                       "command": "python benchmarks/cost_model_forms.py " + " ".join(argv),
                       "record_names": [r["name"] for r in records], "results": out}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
