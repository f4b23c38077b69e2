"""GRPO on the Qwen2-7B shape under a GPU memory cap: 24, 48 and 80 GiB cards emulated on one H200.

Workload as benchmarks/bench_rl_step.py (whose runner this reuses): random init, 8 prompts x 8
samples, 128-token prompts, 256 forced response tokens, one optimizer step per step, the product's
defaults otherwise (auto token budgets, sized under the cap). Each cap runs in its own process with
`trainer.gpu_memory_limit_gib=<cap>` and the options the cost model says it needs (OPTIONS below:
full-parameter 7B needs over 140 GiB, so every cap trains LoRA adapters; 24 GiB also recomputes
activations). Reported per cap: median seconds per step after the first, the run's peak allocated
memory (perf/max_memory_allocated_gb, GiB) and the cost model's predicted peak for the same
configuration (its token budgets as the trainer chose them).

  python benchmarks/small_cards.py --out benchmarks/results/small_cards_h200.json     # one H200
  python benchmarks/small_cards.py --model tiny --prompts 2 --samples 2 --response 4 --steps 2 \\
      --caps 24 --out /tmp/small_cards.json                                            # CPU smoke
"""

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
import bench_rl_step  # noqa: E402
from run_record import command, machine, versions, write_json  # noqa: E402

LORA = ("actor.lora.rank=16", "actor.lora.alpha=32")
OPTIONS = {  # cap (GiB) -> the trainer options it runs with (what the cost model says fits)
    24: LORA + ("parallel.activation_checkpointing=true",),
    48: LORA,
    80: LORA,
}


def predicted_peak(args, cap: int, options: tuple, budgets: dict) -> float | None:
    """The cost model's peak (GiB) for this run: its layout, LoRA, recompute and token budgets."""
    if args.model == "tiny":
        return None
    lora = next((int(o.split("=")[1]) for o in options if o.startswith("actor.lora.rank=")), 0)
    recompute = "parallel.activation_checkpointing=true" in options
    seq = 128 + args.response
    train = budgets.get("max_tokens_per_micro_batch_per_gpu", seq)
    fwd = budgets.get("forward_max_tokens_per_micro_batch_per_gpu", train)
    from dataclasses import replace

    from hybridflow.cost.efficiency import shipped_calibration
    from hybridflow.cost.gpus import get_gpu
    from hybridflow.cost.memory import memory_for
    from hybridflow.cost.shapes import load_shape
    from hybridflow.cost.workload import Workload, make_plan

    shape = load_shape(args.model)
    work = Workload(algorithm="grpo", prompts_per_step=args.prompts,
                    samples_per_prompt=args.samples, prompt_len=128, response_len=args.response,
                    micro_batch_tokens=train, forward_micro_batch_tokens=fwd, lora_rank=lora)
    gpu = replace(get_gpu("H200"), memory_gib=float(cap))
    est = memory_for(shape, gpu, make_plan({"tp": 1, "recompute": recompute}, 1, shape), work,
                     shipped_calibration())
    return round(est.peak_gib, 2)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2_7b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="steps per cap; the first is reported apart")
    ap.add_argument("--caps", default="24,48,80", help="GiB caps, comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for cap in [int(c) for c in args.caps.split(",")]:
            options = OPTIONS.get(cap, LORA)
            bench = bench_rl_step.parse_args([
                "--model", args.model, "--prompts", str(args.prompts), "--samples",
                str(args.samples), "--response", str(args.response), "--steps", str(args.steps),
                "--algos", "grpo", *[x for o in options + (f"trainer.gpu_memory_limit_gib={cap}",)
                                      for x in ("--override", o)]])
            rows, ovr, budgets = bench_rl_step.run("grpo", bench, os.path.join(work, str(cap)))
            med = bench_rl_step.summarize(rows)["median_later_steps"]
            results[str(cap)] = {
                "step_s": round(med["timing_s/step"], 3),
                "peak_gib": round(med.get("perf/max_memory_allocated_gb", 0.0), 2),
                "options": list(options), "predicted_peak_gib": predicted_peak(args, cap, options,
                                                                               budgets),
                "auto_token_budgets": budgets, "overrides": ovr,
                "stages_s": {k[len("timing_s/"):]: round(v, 3) for k, v in med.items()
                             if k.startswith("timing_s/")}}
            print(f"cap {cap} GiB: {results[str(cap)]['step_s']} s/step, peak "
                  f"{results[str(cap)]['peak_gib']} GiB (predicted "
                  f"{results[str(cap)]['predicted_peak_gib']}), {' '.join(options)}", flush=True)
    record = {"benchmark": "GRPO under a GPU memory cap (trainer.gpu_memory_limit_gib)",
              "workload": {"prompts": args.prompts, "samples": args.samples, "prompt_len": 128,
                           "response_len": args.response, "steps": args.steps},
              "machine": machine(), "versions": versions("megatron-core", "transformers"),
              "command": command(), args.model: results}
    if args.out:
        write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
