"""GRPO on the Qwen2-7B shape under a GPU memory cap: 24, 48 and 80 GiB cards emulated on one H200.

Workload as benchmarks/bench_rl_step.py (whose runner this reuses): random init, 8 prompts x 8
samples, 128-token prompts, 256 forced response tokens, one optimizer step per step, the product's
defaults otherwise (auto token budgets, sized under the cap). Each cap runs in its own process with
`trainer.gpu_memory_limit_gib=<cap>` and the options the cost model says it needs (OPTIONS below:
full-parameter 7B needs over 140 GiB, so every cap trains LoRA adapters; 24 GiB also recomputes
activations). Reported per cap: median seconds per step after the first, the run's peak allocated
memory (perf/max_memory_allocated_gb, GiB) and the cost model's predicted peak for the same
configuration (its token budgets as the trainer chose them) and seconds per step. `--extra`
adds overrides to every cap's options (e.g. rollout.free_cache_engine=false: at 24 GiB the
automatic choice frees the generator, whose kept KV cache would hold the update to one-row
micro-batches; false is the A/B).

  python benchmarks/small_cards.py --out benchmarks/results/small_cards_h200.json     # one H200
  python benchmarks/small_cards.py --model tiny --prompts 2 --samples 2 --response 4 --steps 2 \\
      --caps 24 --out /tmp/small_cards.json                                            # CPU smoke

`--offload-params-ab`: instead, the first cap only, with LoRA + actor.offload_optimizer + recompute
+ an fp8 rollout (AB_OPTIONS), run with actor.offload_params=false and =true: the peak, seconds per
step and stage seconds of each (a run that fails, e.g. out of memory under the cap, is recorded with
its exit code) and the cost model's peak and fit for each.

  python benchmarks/small_cards.py --offload-params-ab --caps 24 --prompts 4 --steps 2 \\
      --out benchmarks/results/small_cards_offload_params_h200.json                    # one H200
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
# --offload-params-ab: a quantized rollout leaves the bf16 matrices beside their codes through
# decoding unless actor.offload_params moves them to the host (docs/recipes.md, Small cards)
AB_OPTIONS = LORA + ("parallel.activation_checkpointing=true", "actor.offload_optimizer=true",
                     "rollout.quantization=fp8")


def _option(options: tuple, key: str, default: str = "") -> str:
    return next((o.split("=", 1)[1] for o in options if o.startswith(key + "=")), default)


def predicted(args, cap: int, options: tuple, budgets: dict):
    """The cost model's MemoryEstimate for this run: its layout, LoRA, recompute, offload options,
    rollout quantization and token budgets (None for the tiny model)."""
    if args.model == "tiny":
        return None
    lora = int(_option(options, "actor.lora.rank", "0"))
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
                    micro_batch_tokens=train, forward_micro_batch_tokens=fwd, lora_rank=lora,
                    offload_optimizer=_option(options, "actor.offload_optimizer") == "true",
                    offload_params=_option(options, "actor.offload_params") == "true",
                    rollout_quantization=_option(options, "rollout.quantization", "none"))
    gpu = replace(get_gpu("H200"), memory_gib=float(cap))
    return memory_for(shape, gpu, make_plan({"tp": 1, "recompute": recompute}, 1, shape), work,
                      shipped_calibration())


def predicted_peak(args, cap: int, options: tuple, budgets: dict) -> float | None:
    """The cost model's peak (GiB) for this run."""
    est = predicted(args, cap, options, budgets)
    return None if est is None else round(est.peak_gib, 2)


def predicted_stages(args, cap: int, overrides: list) -> dict | None:
    """The cost model's seconds per stage ("step" the whole) for the trainer config the run
    composed (its token budgets included), as `python -m hybridflow.cost --config` costs it (None
    for the tiny model)."""
    if args.model == "tiny":
        return None
    from hybridflow.cost.efficiency import shipped_calibration
    from hybridflow.cost.from_overrides import from_overrides
    from hybridflow.cost.gpus import get_gpu
    from hybridflow.cost.timing import step_seconds
    from hybridflow.cost.workload import Workload

    keep = [o for o in overrides if not o.startswith(("trainer.output_dir=",
                                                      "trainer.gpu_memory_limit_gib="))]
    shape, plan, fields, _ = from_overrides(keep, world_size=1, free_gib=float(cap))
    stages = step_seconds(shape, get_gpu("H200"), plan, Workload(**fields), shipped_calibration())
    return {k: round(v, 3) for k, v in stages.items() if isinstance(v, float)}


def run_cap(args, cap: int, options: tuple, work: str) -> dict:
    """One run under `cap` GiB with `options`: its median step, peak and the model's prediction
    (a failed run: its exit code, and what the model predicted)."""
    import subprocess

    bench = bench_rl_step.parse_args([
        "--model", args.model, "--prompts", str(args.prompts), "--samples", str(args.samples),
        "--response", str(args.response), "--steps", str(args.steps), "--algos", "grpo",
        *[x for o in options + (f"trainer.gpu_memory_limit_gib={cap}",)
          for x in ("--override", o)]])
    est = None
    try:
        rows, ovr, budgets = bench_rl_step.run("grpo", bench, work)
    except subprocess.CalledProcessError as e:
        est = predicted(args, cap, options, {})
        return {"error": f"exit code {e.returncode}", "options": list(options),
                **({"predicted_peak_gib": round(est.peak_gib, 2), "predicted_fits": est.fits}
                   if est else {})}
    est = predicted(args, cap, options, budgets)
    med = bench_rl_step.summarize(rows)["median_later_steps"]
    sized = [f"algo.{k}={v}" for k, v in budgets.items()]
    stages = predicted_stages(args, cap, list(ovr) + sized)
    return {"step_s": round(med["timing_s/step"], 3),
            "peak_gib": round(med.get("perf/max_memory_allocated_gb", 0.0), 2),
            "options": list(options),
            "predicted_peak_gib": round(est.peak_gib, 2) if est else None,
            "predicted_fits": est.fits if est else None,
            "predicted_peak_phase": est.peak_phase if est else None,
            "predicted_step_s": stages["step"] if stages else None,
            "predicted_stages_s": stages,
            "auto_token_budgets": budgets, "overrides": ovr,
            "stages_s": {k[len("timing_s/"):]: round(v, 3) for k, v in med.items()
                         if k.startswith("timing_s/")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2_7b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="steps per cap; the first is reported apart")
    ap.add_argument("--caps", default="24,48,80", help="GiB caps, comma-separated")
    ap.add_argument("--out", default=None)
    ap.add_argument("--extra", nargs="*", default=[], metavar="OVERRIDE",
                    help="trainer overrides added to every cap's options (an A/B: e.g. "
                         "rollout.free_cache_engine=true)")
    ap.add_argument("--offload-params-ab", action="store_true",
                    help="the first cap only, AB_OPTIONS with actor.offload_params off and on")
    args = ap.parse_args(argv)
    results = {}
    caps = [int(c) for c in args.caps.split(",")]
    with tempfile.TemporaryDirectory() as work:
        if args.offload_params_ab:
            cap = caps[0]
            for on in (False, True):
                options = AB_OPTIONS + (f"actor.offload_params={str(on).lower()}",)
                res = run_cap(args, cap, options, os.path.join(work, str(on)))
                results[f"{cap}_offload_params_{'on' if on else 'off'}"] = res
                print(f"cap {cap} GiB, offload_params={on}: {res.get('step_s', res.get('error'))} "
                      f"s/step, peak {res.get('peak_gib')} GiB (predicted "
                      f"{res.get('predicted_peak_gib')}, fits {res.get('predicted_fits')})",
                      flush=True)
        for cap in [] if args.offload_params_ab else caps:
            options = OPTIONS.get(cap, LORA) + tuple(args.extra)
            res = results[str(cap)] = run_cap(args, cap, options, os.path.join(work, str(cap)))
            print(f"cap {cap} GiB: {res.get('step_s', res.get('error'))} s/step, peak "
                  f"{res.get('peak_gib')} GiB (predicted {res.get('predicted_peak_gib')}), "
                  f"{' '.join(options)}", flush=True)
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
