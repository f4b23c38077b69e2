"""The cost model's quantized-rollout calibration records, from the generation benchmark on one H200.

    python benchmarks/quant_gen_records.py --out benchmarks/results/cost/quant_gen_h200.json

Derived from benchmarks/results/quantized_rollout_h200.json (`generation`, written by
benchmarks/bench_quantized.py): one `calibrate.py` record per (mode, model, batch) of that call,
generation only (metric `timing_s/gen`: the median of 3 warm `Generator.generate` calls), its
config the benchmark's workload: Qwen2-0.5B / Qwen2-1.5B shapes on one H200, `batch` distinct
128-token prompts (one sample each), 256 forced new tokens (no EOS), one generation chunk of the
whole batch, the product's GPU decode path (Triton decode kernels, CUDA graphs, a 64-column KV
window: `decode_kv_window=64`). Modes: bf16 (`rollout_quantization` none), fp8 and int4; the
benchmark's fp8_weight_only mode (a kernel option, rollout.kernel_options.fp8_weight_only_max_rows,
that the cost model has no input for) is left out.

Each (model, batch) is one family: its bf16 record is the baseline its quantized records are
fitted against (calibrate.QUANT_GROUPS: the quantized coefficients see the quantized measurement
minus the bf16 model's miss on the same call), and a leave-one-out holds the family out together.
The machine, versions and command are the benchmark's own.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_record import write_json  # noqa: E402

SOURCE = "benchmarks/results/quantized_rollout_h200.json"
MODES = {"bf16": "none", "fp8": "fp8", "int4": "int4"}   # the benchmark's key -> the config's


def records(bench: dict) -> list[dict]:
    setup = bench.get("setup", {})
    prompt, new = setup.get("prompt_len", 128), setup.get("new_tokens", 256)
    out = []
    for key, mode in MODES.items():
        for model, per in bench["generation"].get(key, {}).items():
            for batch, seconds in per.items():
                b = int(batch)
                out.append({
                    "name": f"{model}-1xH200-gen-b{b}-{key}",
                    "family": f"quant_gen/{model}/b{b}",
                    "config": {"model": model, "gpu": "H200", "num_gpus": 1,
                               "layout": {"tp": 1, "pp": 1, "dp": 1, "tp_gen": 1,
                                          "offload_ref": False, "recompute": False},
                               "algorithm": "grpo", "prompts_per_step": b, "samples_per_prompt": 1,
                               "prompt_len": prompt, "response_len": new, "max_new_tokens": new,
                               "gen_max_batch_size": b, "decode_kv_window": 64,
                               "decode_kernels": "triton", "rollout_quantization": mode},
                    "metrics": {"timing_s/gen": seconds}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default=SOURCE)
    ap.add_argument("--out", default="benchmarks/results/cost/quant_gen_h200.json")
    a = ap.parse_args(argv)
    with open(a.source, encoding="utf-8") as f:
        bench = json.load(f)
    recs = records(bench)
    write_json(a.out, {
        "benchmark": "quantized rollout generation, as cost-model calibration records",
        "machine": bench.get("machine"), "versions": bench.get("versions"),
        "command": bench.get("command"),
        "derived": f"python benchmarks/quant_gen_records.py --source {a.source} --out {a.out}",
        "note": f"derived from {a.source} (`generation`, bench_quantized.py: random init, "
                "128-token prompts + 256 forced tokens, batch 64 and 256, median of 3 warm "
                "calls); machine, versions and command are that run's. Generation only "
                "(timing_s/gen). int4 at the 1.5B shape was not measured (the call's time limit); "
                "fp8_weight_only is left out (no cost-model input).",
        "records": recs})
    print(f"wrote {a.out}: {len(recs)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
