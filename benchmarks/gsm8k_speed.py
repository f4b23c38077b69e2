r"""The GSM8K step at speed, as one results file: benchmarks/results/gsm8k_speed_h200.json.

Assembles what the device calls measured, nothing run here:
- `--step`: a `gsm8k_h200.sh step N` run's metrics.jsonl (the recipe without validation):
  `ours_step_s` and `stages` (medians of steps 2..), each stage's model FLOPs and MFU
  (`mfu.update`, `mfu.ref`: FLOPs of the step's real tokens, the LM head at response positions
  only, attention at the mean row length, over --peak-tflops);
- `--val-run` / `--baseline-val-run`: 60-step runs (`gsm8k_h200.sh variant ...`, metrics.jsonl and
  val_scores.jsonl) of the configuration measured and of today's recipe: `val_accuracy`,
  `baseline_val_accuracy` and the problem-by-problem comparison per validation;
- `--trl`: TRL's run (trl_gsm8k.py's JSON, or bench_vs_trl.py's GSM8K workload) gives `trl_step_s`;
  `--trl-ours-step`: our step run in the same session on the same machine, for `speedup_vs_trl`;
- `--cost` / `--dapo-cost`: `python -m hybridflow.cost --config ... --lengths <probe> --json`
  written BEFORE the run (`cost_model_step_s`), and `--dapo-step` a DAPO run's metrics.jsonl (or
  the gsm8k_step_h200.json `gsm8k_h200.sh step` wrote of it).

  python benchmarks/gsm8k_speed.py --step OUT/step/metrics.jsonl --val-run OUT/base \
      --baseline-val-run benchmarks/results/gsm8k_lora_h200/base \
      --trl benchmarks/results/vs_trl_h200.json --cost cost_before.json \
      --dapo-step OUT/dapo/metrics.jsonl --dapo-cost dapo_cost_before.json \
      --out benchmarks/results/gsm8k_speed_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
import gpu_clocks  # noqa: E402
from run_record import command, write_json  # noqa: E402

H200_BF16_TFLOPS = 989.4  # dense bf16 peak (the MFU denominator; ~790 is what a GEMM reaches)
STAGE_NAMES = {"update_actor": "update", "ref": "ref"}


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def step_summary(path: str, *, model: str, rows_per_step: int, peak_tflops: float) -> dict:
    """Medians over steps 2.. of a step run: step and stage seconds, the stages' model FLOPs
    (per step, from each step's own token counts) and their MFU."""
    from bench_vs_trl import stage_flops
    from gsm8k_variants import gpu_monitor_medians

    from hybridflow.cost.shapes import load_shape

    steps = [r for r in _rows(path) if "timing_s/step" in r]
    timed = [r for r in steps if r["step"] >= 2]
    if not timed:
        raise SystemExit(f"--step {path}: no step after the first (step 1 compiles and captures)")
    med = lambda k: statistics.median(r[k] for r in timed if k in r)  # noqa: E731
    stages = {k.removeprefix("timing_s/"): med(k) for k in timed[0]
              if k.startswith("timing_s/") and k != "timing_s/step"}
    monitor = gpu_monitor_medians(timed)  # the trainer's per-stage clocks, where it logged them
    shape = load_shape(model)
    flops: dict[str, list] = {}
    for r in timed:  # each step's real tokens: prompt + response of its rows
        response = r["response_length/mean"]
        prompt = r["perf/total_num_tokens"] / rows_per_step - response
        f = stage_flops(shape, prompts=rows_per_step, samples=1, prompt_len=prompt,
                        response=response, stages={s: None for s in STAGE_NAMES})
        for s, v in f.items():
            flops.setdefault(s, []).append(v / r[f"timing_s/{s}"])
    peak = peak_tflops * 1e12
    return {"ours_step_s": med("timing_s/step"), "stages": stages, "steps_timed": len(timed),
            "steps": max(r["step"] for r in steps),
            "mfu": {STAGE_NAMES[s]: statistics.median(v) / peak for s, v in flops.items()},
            "flops_per_s_median": {STAGE_NAMES[s]: statistics.median(v) for s, v in flops.items()},
            "peak_memory_gb": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in steps),
            "peak_reserved_gb": max(r.get("perf/max_memory_reserved_gb", 0.0) for r in steps),
            "mean_response_length": statistics.fmean(r["response_length/mean"] for r in timed),
            **({"gpu_monitor": monitor} if monitor else {})}


def dapo_step(path: str) -> dict:
    """{"step_s", "steps_timed"} of a DAPO run: its metrics.jsonl (median of steps 2..) or the JSON
    `gsm8k_h200.sh step` wrote of it (its `ours_step_s`, the same median)."""
    if path.endswith(".json"):
        d = json.load(open(path))
        if "ours_step_s" not in d:
            raise SystemExit(f"--dapo-step {path}: no ours_step_s (not a gsm8k_h200.sh step JSON)")
        return {"step_s": d["ours_step_s"], "steps_timed": d.get("ours_steps_timed")}
    dapo = [r for r in _rows(path) if "timing_s/step" in r and r["step"] >= 2]
    if not dapo:
        raise SystemExit(f"--dapo-step {path}: no step after the first")
    return {"step_s": statistics.median(r["timing_s/step"] for r in dapo), "steps_timed": len(dapo)}


def trl_result(path: str) -> dict:
    """`trl_step_s` and what it came from: a trl_gsm8k.py JSON (its `step_s_median`, the steps after
    the first) or a bench_vs_trl.py JSON's GSM8K workload."""
    d = json.load(open(path))
    if d.get("benchmark") == "trl_gsm8k":
        if not d.get("step_s_median"):
            raise SystemExit(f"--trl {path}: no step_s_median (TRL ran fewer than 2 steps)")
        cfg = d.get("config", {})
        return {"trl_step_s": d["step_s_median"], "trl_step_s_all": d["step_s"],
                "trl_config": {k: cfg.get(k) for k in ("prompts_per_step", "samples", "micro_batch",
                                                       "gradient_checkpointing", "weights")}}
    for name, w in d.get("workloads", {}).items():
        if "gsm8k" in name.lower() and "trl_step_s" in w:
            return {"trl_step_s": w["trl_step_s"], "trl_step_s_all": w.get("trl_step_s_all")}
    raise SystemExit(f"--trl {path}: neither a trl_gsm8k.py JSON nor a GSM8K workload with trl_step_s")


def cost_prediction(path: str, measured_s: float) -> dict:
    """`cost_model_step_s`, its error against `measured_s`, and where the prediction came from
    (the JSON's `source`, when it says)."""
    d = json.load(open(path))
    if "step_seconds" not in d:
        raise SystemExit(f"--cost {path}: no step_seconds (python -m hybridflow.cost ... --json)")
    out = {"cost_model_step_s": d["step_seconds"], "cost_model_error": d["step_seconds"] / measured_s - 1}
    if d.get("source"):  # when and from what the prediction was made
        out["cost_model_source"] = d["source"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", required=True, help="metrics.jsonl of `gsm8k_h200.sh step N`")
    ap.add_argument("--val-run", help="run dir (metrics.jsonl, val_scores.jsonl) of >= 60 steps")
    ap.add_argument("--baseline-val-run", help="today's recipe, same steps and seed")
    ap.add_argument("--trl", help="a trl_gsm8k.py JSON, or a bench_vs_trl.py JSON with the GSM8K workload")
    ap.add_argument("--trl-ours-step", help="metrics.jsonl of our `step N` run beside TRL's on the "
                    "same machine (the speed-up is taken against it; default: --step)")
    ap.add_argument("--cost", help="the cost model's --json prediction of this step, made before")
    ap.add_argument("--dapo-step", help="metrics.jsonl of a DAPO run (algo=dapo) of the recipe, "
                    "or the gsm8k_step_h200.json `gsm8k_h200.sh step` wrote of it")
    ap.add_argument("--dapo-cost", help="the cost model's --json prediction of the DAPO step")
    ap.add_argument("--machine-from", help="a JSON written on the GPU machine (gsm8k_h200.sh "
                    "step's report) whose machine and versions the file names")
    ap.add_argument("--status", help="what the file shows and what it lacks, in words")
    ap.add_argument("--model", default="qwen2_5_coder_0_5b")
    ap.add_argument("--rows", type=int, default=512, help="sequences per step (64 x 8)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                    help="dense bf16 peak (H100 SXM and H200 share it)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from gsm8k_variants import paired, summarize

    out = {"benchmark": "GSM8K GRPO step (experiment=gsm8k_qwen_coder_0_5b) at speed",
           "command": command(), "peak_tflops": a.peak_tflops,
           **({k: json.load(open(a.machine_from))[k] for k in ("machine", "versions")}
              if a.machine_from else {}),
           **step_summary(a.step, model=a.model, rows_per_step=a.rows, peak_tflops=a.peak_tflops)}
    if out["steps_timed"] < 20:
        out["note"] = f"median of {out['steps_timed']} steps (the target asks for >= 20)"
    clocks = os.path.join(os.path.dirname(os.path.abspath(a.step)), "gpu_clocks.csv")
    if os.path.isfile(clocks):  # what the card ran at (gsm8k_h200.sh records it beside the run)
        out["gpu_clocks"] = gpu_clocks.summarise(clocks)
    if a.val_run:
        out["val_accuracy"] = summarize(a.val_run)["val_accuracy"]
    if a.baseline_val_run:
        out["baseline_val_accuracy"] = summarize(a.baseline_val_run)["val_accuracy"]
        mine = os.path.join(a.val_run or "", "val_scores.jsonl")
        base = os.path.join(a.baseline_val_run, "val_scores.jsonl")
        if a.val_run and os.path.isfile(mine) and os.path.isfile(base):
            out["vs_baseline_problem_by_problem"] = paired(base, mine)
    if a.trl:
        out.update(trl_result(a.trl), trl_source=a.trl)
        ours = out["ours_step_s"]
        if a.trl_ours_step:
            ours = step_summary(a.trl_ours_step, model=a.model, rows_per_step=a.rows,
                                peak_tflops=a.peak_tflops)["ours_step_s"]
            out["trl_ours_step_s"] = ours
        out["speedup_vs_trl"] = out["trl_step_s"] / ours
    if a.cost:
        out.update(cost_prediction(a.cost, out["ours_step_s"]))
    if a.dapo_step:
        out["dapo"] = dapo_step(a.dapo_step)
        if a.dapo_cost:
            out["dapo"].update(cost_prediction(a.dapo_cost, out["dapo"]["step_s"]))
    if a.status:
        out["status"] = a.status
    write_json(a.out, out)
    mfu = " ".join(f"{k} {v:.1%}" for k, v in out["mfu"].items())
    print(f"step {out['ours_step_s']:.3f} s ({out['steps_timed']} steps)  MFU {mfu}  "
          f"peak {out['peak_memory_gb']:.1f} GB" +
          (f"  TRL {out['trl_step_s']:.1f} s ({out['speedup_vs_trl']:.1f}x)" if a.trl else ""))
    return out


if __name__ == "__main__":
    main()
