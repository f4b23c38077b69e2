"""Two passes' kernels side by side: a trainer step's profiled stage against a benchmark's pass.

Where a trainer's update runs slower than the packed-pass bench at the same lengths, this says
whether the same kernels run slower (a lower clock, a slower card: the compute-bound GEMMs move,
the memory-bound kernels do not) or whether one side runs kernels the other does not (more work).

  python benchmarks/compare_kernels.py \\
      --a OUT/prof/step3_rank0.json:update_actor \\
      --b OUT/pp_step3_uniform.json:packed_fa4/update [--out compare.json]

A side is FILE:WHERE. FILE is a trainer profile summary (trainer.profile_steps writes
`stepN_rankR.json`; WHERE a stage: update_actor, ref, gen) or a bench_packed_pass.py JSON run with
--profile (WHERE variant/update or variant/ref). Kernels match by the first 60 characters of their
names. Per kernel: seconds and calls on each side and b / a; totals over the kernels both sides
list, split into GEMMs (cuBLAS / CUTLASS GEMM kernels) and the rest, and what each side lists
alone. Each side's list is its top kernels only (the profile's trainer.profile_top_kernels, the
bench's 80), so "alone" can mean "below the other side's cut".
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_record import write_json  # noqa: E402

GEMM_MARKS = ("nvjet", "gemm", "xmma", "cutlass_80", "sm90_xmma", "splitkreduce")
KEY = 60


def is_gemm(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in GEMM_MARKS) and "flash" not in low


def load_side(spec: str) -> dict:
    """{kernel name[:KEY]: (seconds, calls)} of one side (see the module docstring)."""
    path, sep, where = spec.rpartition(":")
    if not sep or not path:
        raise SystemExit(f"{spec!r}: expected FILE:WHERE (a stage, or variant/update|ref)")
    d = json.load(open(path))
    if "stages" in d:  # a trainer profile summary
        if where not in d["stages"]:
            raise SystemExit(f"{spec}: no stage {where!r} (has {sorted(d['stages'])})")
        rows = [(k["kernel"], k["s"], k["calls"]) for k in d["stages"][where]["top"]]
    elif "results" in d:  # bench_packed_pass.py --profile
        variant, _, pass_ = where.partition("/")
        r = d["results"].get(variant)
        key = f"{pass_}_top_kernels"
        if r is None or key not in r:
            raise SystemExit(f"{spec}: no {key} for variant {variant!r} "
                             f"(variants {sorted(d['results'])}; run the bench with --profile)")
        rows = [(k["name"], k["cuda_s"], k["calls"]) for k in r[key]["top"]]
    else:
        raise SystemExit(f"{path}: neither a trainer profile summary (stages) nor a "
                         "bench_packed_pass.py JSON (results)")
    out: dict = {}
    for name, s, calls in rows:
        s0, c0 = out.get(name[:KEY], (0.0, 0))
        out[name[:KEY]] = (s0 + s, c0 + calls)
    return out


def compare(a: dict, b: dict) -> dict:
    both = [k for k in a if k in b]
    rows = sorted(({"kernel": k, "a_s": a[k][0], "a_calls": a[k][1], "b_s": b[k][0],
                    "b_calls": b[k][1], "b_over_a": b[k][0] / a[k][0] if a[k][0] else None}
                   for k in both), key=lambda r: -max(r["a_s"], r["b_s"]))

    def total(keys, side, gemm):
        return sum(side[k][0] for k in keys if is_gemm(k) == gemm)

    out = {"kernels": rows, "both": {}}
    for label, gemm in (("gemm", True), ("other", False)):
        ta, tb = total(both, a, gemm), total(both, b, gemm)
        out["both"][label] = {"a_s": ta, "b_s": tb, "b_over_a": tb / ta if ta else None}
    out["a_only"] = sorted(({"kernel": k, "s": a[k][0], "calls": a[k][1]} for k in a if k not in b),
                           key=lambda r: -r["s"])
    out["b_only"] = sorted(({"kernel": k, "s": b[k][0], "calls": b[k][1]} for k in b if k not in a),
                           key=lambda r: -r["s"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="FILE:WHERE (the trainer's profile, say)")
    ap.add_argument("--b", required=True, help="FILE:WHERE (the bench's pass, say)")
    ap.add_argument("--rows", type=int, default=25, help="kernels printed")
    ap.add_argument("--out", help="the comparison as JSON")
    a = ap.parse_args(argv)
    out = {"a": a.a, "b": a.b, **compare(load_side(a.a), load_side(a.b))}
    for label, t in out["both"].items():
        ratio = f"{t['b_over_a']:.3f}" if t["b_over_a"] else "-"
        print(f"{label:5s} kernels on both sides: a {t['a_s'] * 1e3:9.1f} ms  "
              f"b {t['b_s'] * 1e3:9.1f} ms  b/a {ratio}")
    for r in out["kernels"][:a.rows]:
        ratio = f"{r['b_over_a']:.3f}" if r["b_over_a"] else "-"
        print(f"{r['a_s'] * 1e3:9.1f} {r['a_calls']:6d} | "
              f"{r['b_s'] * 1e3:9.1f} {r['b_calls']:6d} | {ratio:>6s}  {r['kernel']}")
    for side in ("a_only", "b_only"):
        if out[side]:
            print(f"{side}: " + ", ".join(f"{r['kernel'][:40]} {r['s'] * 1e3:.1f} ms"
                                          for r in out[side][:8]))
    if a.out:
        write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
