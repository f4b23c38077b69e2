"""The cost model's variable-length calibration records, from the GSM8K runs on one H200 or H100.

    python benchmarks/varlen_records.py --out benchmarks/results/cost/varlen_gsm8k.json

Thirteen records of the GSM8K recipe (hybridflow/conf/experiment/gsm8k_qwen_coder_0_5b.yaml:
Qwen2.5-Coder-0.5B, 64 prompts x 8 samples, responses up to 1,024 tokens, token-budget packed
micro-batches, generator kept, row compaction, KV windows), each a `calibrate.py` record whose
config carries the step's lengths (`Workload.response_lengths`, fitted by cost.lengths to the run's
response-length statistics; for the fa4 families the run's own lengths instead, pooled, where its
`<prefix>rollout_lengths.jsonl` is committed beside its `<prefix>metrics.jsonl`: run_lengths) and
the code's options as they were then:
- family "grpo_now" (today's code: Triton decode layers, fused element-wise ops, gradient
  accumulation fusion), from benchmarks/results/gsm8k_step_h200.json: the recipe as written and
  its speed options on auto (budgets 64,000 / 177,920, KV window 192). That run kept only its mean
  response length per step: the tail (share at the cap, shortest row) and the prompts are the
  GRPO probe's below (same model and data).
- family "grpo_today" (the code of 2026-12-04: the above plus varlen packed attention, the fused
  sampler, RoPE tables once per pass, LoRA's fused linears), from
  benchmarks/results/gsm8k_graphs_h200/: the recipe as written, and with
  parallel.train_cuda_graphs (its packed update micro-batches padded to the budget and graphed);
  12 steps each, lengths and prompts from their own metrics; and the recipe with LoRA (rank 32),
  12 steps in the same call, its mean length from its summary and the rest from the recipe run.
- family "grpo_then" (the code the DAPO run had, 2026-12-01: PyTorch decode layers, unfused element-wise
  ops, no gradient accumulation fusion): the GRPO probe run beside the DAPO run, and the 124-step
  packed GRPO run (before the response-only LM head and bf16 logits), from their metrics.jsonl.
- family "grpo_older" (the 124-step run's code hours before it, before sequence packing and the
  generation options: a generator built every step, no compaction or KV window, the LM head and
  fp32 logits at every position): two runs with unpacked token budgets (lr 3e-6 and 1e-5), their
  ref and update passes only (generation then re-captured its graphs every step, which the model
  does not cost).
- family "dapo" (the same code as grpo_then): DAPO with dynamic sampling, 39 steps: generation
  rounds and prompt batches per step (gen_rounds, gen_prompt_factor: the means), 1,536 rows per
  call.
- families "grpo_fa4" and "dapo_fa4" (the code of 2026-12-06 with its defaults: FlashAttention-4
  packed attention, the inverse-CDF draw of the fused sampler, own-column K/V reads, the
  speculative tail from 16 rows with 4 drafts at the run's own tokens per row-step), from
  benchmarks/results/gsm8k_speed_h100/ and gsm8k_speed_h200/: the recipe's 60-step runs on one
  H100 and one H200, and DAPO (algo=dapo reward.overlong_buffer.len=256
  rollout.max_batch_size=1536) for 10 steps on the H100. The DAPO step on the H200
  (gsm8k_speed_h200/dapo/, medians only) is not a record: it is the check of the fit.
Measured: medians over steps 2.. for the GRPO records; for DAPO the means over steps 2..40 (its
steps are a mix of 1 round of 2 or 3 batches and 2 rounds, whose mean is what the model's mean
rounds and batches describe); timing_s/step leaves validation out (it is timed apart). The raw
metrics.jsonl of the older runs live in git history (RAW below; `git show` reads them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, write_json  # noqa: E402
from hybridflow.cost.lengths import fit_stats, load_lengths, run_file  # noqa: E402
from hybridflow.metrics import MetricsLogger  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAW_COMMIT = "4b3c290^"   # the commit before benchmarks/results' raw run folders were pruned
RAW = {"budget_lr3e-6": "benchmarks/results/gsm8k_token_budget/lr3e-6/metrics.jsonl",
       "budget_lr1e-5": "benchmarks/results/gsm8k_token_budget/lr1e-5/metrics.jsonl",
       "probe": "benchmarks/results/gsm8k_grpo_probe/metrics.jsonl",
       "packed": "benchmarks/results/gsm8k_packed/metrics.jsonl",
       "dapo": "benchmarks/results/gsm8k_dapo/metrics.jsonl"}
# "reward" (not a modelled stage: part of "other") gives calibrate row_overhead_s per generated row
STAGES = ("gen", "reshard", "ref", "update_actor", "reward")
CAP = 1024

BASE = {"model": "qwen2_5_coder_0_5b", "gpu": "H200", "num_gpus": 1,
        "layout": {"tp": 1, "pp": 1, "dp": 1, "tp_gen": 1, "offload_ref": False, "recompute": False},
        "algorithm": "grpo", "prompts_per_step": 64, "samples_per_prompt": 8, "ppo_epochs": 1,
        "mini_batches": 1, "micro_batch_tokens": 20480, "forward_micro_batch_tokens": 40960,
        "use_reference": True, "skip_old_log_prob": True, "keep_generator": True,
        "max_new_tokens": CAP, "gen_max_batch_size": 512, "compact_finished_rows": True,
        "decode_kv_window": 256, "dynamic_bsz": True, "pack_sequences": True, "dtype": "bf16"}
NOW = {"decode_kernels": "triton", "fused_elementwise": True, "gradient_accumulation_fusion": True}
THEN = {"decode_kernels": "torch", "fused_elementwise": False, "gradient_accumulation_fusion": False}
# today's defaults as the cost CLI derives them from the recipe on a GPU with flash-attn-4
# (from_config.workload_fields): what varlen_holdout.THEN_ROLLOUT turns off for the older families
FA4 = {**NOW, "packed_attention": "fa4", "own_columns_only": True, "cdf_sampler": True,
       "spec_rows": 16, "spec_draft_tokens": 4}
SPEED = {"H100": "benchmarks/results/gsm8k_speed_h100", "H200": "benchmarks/results/gsm8k_speed_h200"}
MACHINE = {"H100": {"gpu": "NVIDIA H100 80GB HBM3", "host": "vm"},
           "H200": {"gpu": "NVIDIA H200", "host": "vm"}}


def raw_metrics(key: str) -> list[dict]:
    text = subprocess.run(["git", "-C", ROOT, "show", f"{RAW_COMMIT}:{RAW[key]}"], check=True,
                          capture_output=True, text=True).stdout
    return [r for r in map(json.loads, filter(str.strip, text.splitlines())) if "timing_s/step" in r]


def med(rows, key):
    return statistics.median(float(r[key]) for r in rows if key in r)


def lengths(mean, shape: dict, rows: int) -> list[int]:
    return list(fit_stats(mean=mean, cap=CAP, clip_ratio=shape["clip_ratio"],
                          shortest=min(shape["min"], mean), rows=rows))


def run_lengths(src: str, shape: dict, rows: int) -> tuple[list[int], dict]:
    """A run's response lengths and where they came from: its exact lengths (pooled over its
    steps to quantile points) where the trainer's rollout_lengths.jsonl sits beside its metrics
    (cost.lengths.run_file: `<prefix>rollout_lengths.jsonl` beside `<prefix>metrics.jsonl`), else
    `rows` lengths fitted to its statistics."""
    beside = run_file(os.path.join(ROOT, src), MetricsLogger.LENGTHS_FILE)
    if beside.is_file():
        return (list(load_lengths(beside, cap=CAP)["response_lengths"]),
                {"lengths_from": os.path.relpath(beside, ROOT)})
    return lengths(shape["mean"], shape, rows), {}


def shape_of(rows) -> dict:
    return {"clip_ratio": med(rows, "response_length/clip_ratio"),
            "min": med(rows, "response_length/min"), "mean": med(rows, "response_length/mean")}


def record(name, family, config, metrics, source, lens):
    return {"name": name, "family": family, "source_run": source, "lengths": lens,
            "config": config, "metrics": {k: round(v, 6) for k, v in metrics.items()}}


def lora_today(recipe: dict, tail: dict, prompts: dict) -> dict:
    """The recipe with LoRA (rank 32, alpha 64, lr 5e-5), run in the same call as the recipe
    record: its summary kept each step's mean response length and the stage medians, so the
    tail (share at the cap, shortest row) is the recipe run's, and so are the prompts (same data
    and seed)."""
    src = "benchmarks/results/gsm8k_graphs_h200/lora/gsm8k_step_h200.json"
    run = json.load(open(os.path.join(ROOT, src)))
    mean = statistics.median(v for step, v in run["per_step"]["response_length/mean"] if step > 1)
    cfg = {**recipe, "lora_rank": 32, "response_lengths": lengths(mean, tail, 512)}
    m = {f"timing_s/{k}": run["ours_stages_s"][k] for k in STAGES} | {
        "timing_s/step": run["ours_step_s"]}
    return record("gsm8k-grpo-today-lora", "grpo_today", cfg, m, src,
                  {"mean": mean, **prompts, "tail_from": "the recipe run of the same call"})


def run_rows(src: str) -> list[dict]:
    """A run's steps from its metrics.jsonl in the working tree, the first (graph capture) dropped."""
    return [r for r in map(json.loads, filter(str.strip, open(os.path.join(ROOT, src))))
            if "timing_s/step" in r][1:]


def fa4_today() -> list[dict]:
    """Families grpo_fa4 (the recipe's 60-step runs, H100 and H200) and dapo_fa4 (DAPO's 10 steps
    on the H100), each with its own lengths, prompts and speculative tokens per row-step."""
    recs = []
    for gpu in ("H100", "H200"):
        src = f"{SPEED[gpu]}/base/metrics.jsonl"
        rows = run_rows(src)
        s = shape_of(rows)
        today = {"prompt_len": round(med(rows, "prompt_length/mean")),
                 "prompt_len_max": round(med(rows, "prompt_length/max"))}
        lens, origin = run_lengths(src, s, 512)
        cfg = {**BASE, **FA4, **today, "gpu": gpu,
               "spec_tail_tokens_per_step": med(rows, "rollout/spec_tokens_per_row_step"),
               "response_lengths": lens}
        m = {f"timing_s/{k}": med(rows, f"timing_s/{k}") for k in STAGES}
        m["timing_s/step"] = med(rows, "timing_s/step")   # (validation is timed apart)
        recs.append(record(f"gsm8k-grpo-fa4-{gpu.lower()}", "grpo_fa4", cfg, m, src,
                           {**s, **today, **origin}) | {"machine": MACHINE[gpu]})
    src = f"{SPEED['H100']}/dapo_metrics.jsonl"
    dapo = run_rows(src)   # as the dapo family: means over the steps of the mean rounds, batches
    s = shape_of(dapo)
    s["clip_ratio"] = statistics.fmean(r["response_length/clip_ratio"] for r in dapo)
    rounds = statistics.fmean(r["dynamic_sampling/rounds"] for r in dapo)
    batches = statistics.fmean(r["dynamic_sampling/batches"] for r in dapo)
    d_prompts = {"prompt_len": round(med(dapo, "prompt_length/mean")),
                 "prompt_len_max": round(med(dapo, "prompt_length/max"))}
    d_lens, d_origin = run_lengths(src, s, round(512 * batches / rounds))
    cfg = {**BASE, **FA4, **d_prompts, "gpu": "H100", "use_reference": False,
           "gen_max_batch_size": 1536, "gen_rounds": round(rounds, 4),
           "gen_prompt_factor": round(batches, 4),
           "gen_batches_per_round": int(max(r["dynamic_sampling/batches"] for r in dapo)),
           "spec_tail_tokens_per_step": med(dapo, "rollout/spec_tokens_per_row_step"),
           "response_lengths": d_lens}
    m = {f"timing_s/{k}": statistics.fmean(r[f"timing_s/{k}"] for r in dapo)
         for k in ("gen", "reshard", "update_actor", "reward")}
    m["timing_s/step"] = statistics.fmean(r["timing_s/step"] for r in dapo)
    recs.append(record("gsm8k-dapo-fa4-h100", "dapo_fa4", cfg, m, src,
                       {**s, **d_prompts, "rounds": rounds, "batches": batches, **d_origin})
                | {"machine": MACHINE["H100"]})
    return recs


def build() -> list[dict]:
    probe, packed, dapo = raw_metrics("probe")[1:], raw_metrics("packed")[1:], raw_metrics("dapo")[1:]
    prompts = {"prompt_len": round(med(probe, "prompt_length/mean")),
               "prompt_len_max": round(med(probe, "prompt_length/max"))}
    tail = shape_of(probe)
    recs = []
    step = json.load(open(os.path.join(ROOT, "benchmarks/results/gsm8k_step_h200.json")))
    for variant, extra in (("recipe", {}),
                           ("auto", {"micro_batch_tokens": 64000, "forward_micro_batch_tokens": 177920,
                                     "decode_kv_window": 192})):
        run = step[variant]
        mean = run["mean_response_length"]
        cfg = {**BASE, **NOW, **prompts, **extra, "response_lengths": lengths(mean, tail, 512)}
        m = {f"timing_s/{s}": run["ours_stages_s"][s] for s in STAGES} | {
            "timing_s/step": run["ours_step_s"]}
        recs.append(record(f"gsm8k-grpo-now-{variant}", "grpo_now", cfg, m,
                           "benchmarks/results/gsm8k_step_h200.json", {"mean": mean, **prompts,
                                                                       "tail_from": "grpo probe"}))
    # (that code padded every packed micro-batch to the graphs' shape: graph_min_fill 0)
    for variant, extra in (("recipe", {}),
                           ("train-graphs", {"train_cuda_graphs": True, "graph_min_fill": 0.0})):
        src = f"benchmarks/results/gsm8k_graphs_h200/{'full' if variant == 'recipe' else 'full_graphs'}/metrics.jsonl"
        rows = [r for r in map(json.loads, open(os.path.join(ROOT, src))) if "timing_s/step" in r][1:]
        s = shape_of(rows)
        today = {"prompt_len": round(med(rows, "prompt_length/mean")),
                 "prompt_len_max": round(med(rows, "prompt_length/max"))}
        cfg = {**BASE, **NOW, **today, **extra, "packed_attention": "varlen",
               "response_lengths": lengths(s["mean"], s, 512)}
        m = {f"timing_s/{k}": med(rows, f"timing_s/{k}") for k in STAGES}
        m["timing_s/step"] = med(rows, "timing_s/step")
        recs.append(record(f"gsm8k-grpo-today-{variant}", "grpo_today", cfg, m, src, {**s, **today}))
        if variant == "recipe":
            recs.append(lora_today(cfg, s, today))
    for name, rows, extra in (("gsm8k-grpo-then-probe", probe, {}),
                              ("gsm8k-grpo-then-124steps", packed,
                               {"response_logits_only": False, "bf16_logits": False})):
        s = shape_of(rows)
        cfg = {**BASE, **THEN, **prompts, **extra, "response_lengths": lengths(s["mean"], s, 512)}
        m = {f"timing_s/{k}": med(rows, f"timing_s/{k}") for k in STAGES}
        m["timing_s/step"] = med(rows, "timing_s/step")   # (validation is timed apart)
        recs.append(record(name, "grpo_then", cfg, m, RAW["probe" if rows is probe else "packed"],
                           {**s, **prompts}))
    for key in ("budget_lr3e-6", "budget_lr1e-5"):   # unpacked token budgets, fresh generator
        rows = raw_metrics(key)[1:]
        s = shape_of(rows)
        cfg = {**BASE, **THEN, **prompts, "pack_sequences": False, "keep_generator": False,
               "compact_finished_rows": False, "decode_kv_window": 0, "response_logits_only": False,
               "bf16_logits": False, "prefill_once_per_prompt": False,
               "response_lengths": lengths(s["mean"], s, 512)}
        m = {f"timing_s/{k}": med(rows, f"timing_s/{k}") for k in ("ref", "update_actor")}
        recs.append(record(f"gsm8k-grpo-older-{key}", "grpo_older", cfg, m, RAW[key], {**s, **prompts}))
    s = shape_of(dapo)
    s["clip_ratio"] = statistics.fmean(r["response_length/clip_ratio"] for r in dapo)
    rounds = statistics.fmean(r["dynamic_sampling/rounds"] for r in dapo)
    batches = statistics.fmean(r["dynamic_sampling/batches"] for r in dapo)
    rows = round(512 * batches / rounds)
    d_prompts = {"prompt_len": round(med(dapo, "prompt_length/mean")),
                 "prompt_len_max": round(med(dapo, "prompt_length/max"))}
    cfg = {**BASE, **THEN, **d_prompts, "use_reference": False, "gen_max_batch_size": 1536,
           "gen_rounds": round(rounds, 4), "gen_prompt_factor": round(batches, 4),
           # the kept generator's cache is its largest call: a round of 3 prompt batches
           "gen_batches_per_round": int(max(r["dynamic_sampling/batches"] for r in dapo)),
           "response_lengths": lengths(s["mean"], s, rows)}
    m = {f"timing_s/{k}": statistics.fmean(r[f"timing_s/{k}"] for r in dapo)
         for k in ("gen", "reshard", "update_actor", "reward")}
    m["timing_s/step"] = statistics.fmean(r["timing_s/step"] for r in dapo)
    recs.append(record("gsm8k-dapo-then", "dapo", cfg, m, RAW["dapo"],
                       {**s, **d_prompts, "rounds": rounds, "batches": batches}))
    return recs + fa4_today()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    write_json(a.out, {"benchmark": "GSM8K steps as variable-length cost-model records",
                       "machine": {"gpu": "NVIDIA H200", "host": "vm"}, "command": command(),
                       "records": build()})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
