r"""The GSM8K recipe beside its variants, same code and seed: val accuracy per step (and problem by
problem against the base run: validation.paired_comparison, McNemar's exact test), step and stage
medians, peak memory, and the rollout/training mismatch per step.

Variants (overrides on experiment=gsm8k_qwen_coder_0_5b, or the experiment they name):
  base     the recipe as written (bf16 rollouts)
  fp8      rollout.quantization=fp8 (sets algo.tis_imp_ratio_cap=2.0 itself)
  int4     rollout.quantization=int4
  lora     actor.lora.rank=32 alpha=64 (all-linear), actor_optim.lr=5e-5 (PEFT users' range; at
           alpha=32 and 3e-5 it trailed the full run for its first 29 steps), eager update
  lora_graphs  the same with the update's layers as CUDA graphs (parallel.train_cuda_graphs, a
           LoRA run's default on a GPU)
  partial  rollout.partial (512 decode steps per step, 32 extra prompts in flight), TIS cap 2.0,
           rollout.max_batch_size=576 (the steady state's rows; the first step runs in two chunks)
  partial_768  the same at 768 rows (the first step's; the 60-step curves' setting)
  graphs   the full-parameter update's layers as CUDA graphs (parallel.train_cuda_graphs)
  quack    the MLPs' SwiGLU inside quack's GEMM epilogues (parallel.mlp_kernels=quack)
  spec     rollout.speculative (the tail from 16 running rows by speculative sampling with n-gram
           drafts, 4 per row and step): the same samples' distribution, fewer tail steps; on
           by default where the tail runs the decode kernels (auto), so `nospec` is its A/B
  spec_r32 / spec_r32_d8 / spec_d8  the tail from 32 running rows and / or 8 drafts per row and
           step (rollout.speculative.max_rows / draft_tokens) instead of 16 and 4: an earlier
           start and longer drafts against a dearer tail step (on the recipe: no gain, the
           results in gsm8k_spec_tail_h100.json)
  spec_torch_advance  the tail step's acceptance and bookkeeping as ~90 small PyTorch kernels
           (rollout.speculative.fused_advance=false) instead of the two Triton kernels the
           default runs with the recipe's unfiltered sampling (the results in
           gsm8k_spec_advance_h100.json)
  swiglu_triton  the training SwiGLU's backward on kernels/swiglu_train.py
           (parallel.swiglu_backward=triton) instead of Megatron's compiled swiglu_back
  rope_from_qkv  the training RoPE reading q in the QKV projection's groups
           (parallel.rope_from_qkv=true) instead of Megatron's reshaped copy of it
  nomonitor  no GPU monitor thread (trainer.gpu_monitor_interval_s=0): the A/B of its cost
           (on by default where nvidia-ml-py is installed)
  reward_async  the rule reward scored on a worker thread behind the reference pass
           (reward.launch_reward_fn_async)
  reward_in_pass  the rule reward scored on the main thread inside the reference pass, while
           the device works through its launched kernels (reward.score_in_pass)
  prefill_w1  each prefill at its widest prompt (rollout.kernel_options.prefill_width_multiple=1),
           one prefill shape per prompt width; the default on a GPU rounds widths up to 64
  next_fit  packed micro-batches by sorted next-fit (algo.balance_micro_batches=false): a step a
           few rows past a multiple of the budget runs a last micro-batch of those few rows; the
           default deals them evenly into the fewest that hold the rows
  lmchunk  the LM head and log-probs in chunks of 4,096 positions (parallel.lm_head_chunk_tokens):
           no micro-batch's whole logits (up to ~9 GB in the ref pass) allocated at once
  dapo     algo=dapo reward.overlong_buffer.len=256 rollout.max_batch_size=1536 (DAPO's recipe on
           this workload; each dynamic-sampling round sized in prompts, the preset's default)
  dapo_batches  the same with whole prompt batches per round
           (algo.dynamic_sampling.round_confidence=null)
  tools    experiment=gsm8k_tools_qwen_coder_0_5b (multi-turn, code interpreter; tool results fed
           through the decode step, each step launched before the last is read: the defaults)
  tools_fed  the same without lookahead (rollout.multi_turn.lookahead=false)
  tools_held  results held and prefilled by an eager extend (rollout.multi_turn.append=prefill)

On one H200, after `bash benchmarks/gsm8k_h200.sh setup`, one variant per device call (each ~6-7
minutes for 60 steps with validation every 5), resumable while the machine stays warm:
  bash benchmarks/gsm8k_h200.sh variant base 560      # RUN_DIR /tmp/gsm8k_base, OUT/base
  bash benchmarks/gsm8k_h200.sh variant fp8 560
  python benchmarks/gsm8k_variants.py --runs $OUT --out $OUT/gsm8k_variants_h200.json
Step times only (no validation), several variants in one call on the same warm machine:
  bash benchmarks/gsm8k_h200.sh ab 5 base nospec graphs  # OUT/NAME, OUT/ab_summary.json
Run the variants one after another, never two on the GPU at once: two GSM8K runs sharing an H200
took 10.6 and 14.5 s per step against ~5 s each alone (time-slicing, no overlap to gain).
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
from pass_boundaries import per_200k  # noqa: E402
from run_record import write_json  # noqa: E402

VARIANTS = {
    "base": "",
    "fp8": "rollout.quantization=fp8",
    "int4": "rollout.quantization=int4",
    "kv_fp8": "rollout.kv_cache_dtype=fp8",
    "lora": ("actor.lora.rank=32 actor.lora.alpha=64 actor_optim.lr=5e-5 "
             "parallel.train_cuda_graphs=false"),
    "lora_graphs": ("actor.lora.rank=32 actor.lora.alpha=64 actor_optim.lr=5e-5 "
                    "parallel.train_cuda_graphs=true"),
    "partial": ("rollout.partial.enable=true rollout.partial.max_decode_steps=512 "
                "rollout.partial.extra_prompts=32 rollout.max_batch_size=576 "
                "algo.tis_imp_ratio_cap=2.0"),
    "partial_768": ("rollout.partial.enable=true rollout.partial.max_decode_steps=512 "
                    "rollout.partial.extra_prompts=32 rollout.max_batch_size=768 "
                    "algo.tis_imp_ratio_cap=2.0"),
    "graphs": "parallel.train_cuda_graphs=true",
    "quack": "parallel.mlp_kernels=quack",
    "spec": "rollout.speculative.enable=true",
    "nospec": "rollout.speculative.enable=false",
    "spec_r32": "rollout.speculative.max_rows=32",
    "spec_r32_d8": "rollout.speculative.max_rows=32 rollout.speculative.draft_tokens=8",
    "spec_d8": "rollout.speculative.draft_tokens=8",
    "spec_torch_advance": "rollout.speculative.fused_advance=false",
    "swiglu_triton": "parallel.swiglu_backward=triton",
    "rope_from_qkv": "parallel.rope_from_qkv=true",
    "nomonitor": "trainer.gpu_monitor_interval_s=0",
    "varlen": "algo.packed_attention=varlen",
    "reward_async": "reward.launch_reward_fn_async=true",
    "reward_in_pass": "reward.score_in_pass=true",
    "prefill_w1": "rollout.kernel_options.prefill_width_multiple=1",
    "lmchunk": "parallel.lm_head_chunk_tokens=4096",
    "next_fit": "algo.balance_micro_batches=false",
    "dapo": "algo=dapo reward.overlong_buffer.len=256 rollout.max_batch_size=1536",
    "dapo_batches": ("algo=dapo reward.overlong_buffer.len=256 rollout.max_batch_size=1536 "
                     "algo.dynamic_sampling.round_confidence=null"),
    "tools": "experiment=gsm8k_tools_qwen_coder_0_5b",
    "tools_fed": "experiment=gsm8k_tools_qwen_coder_0_5b rollout.multi_turn.lookahead=false",
    "tools_held": "experiment=gsm8k_tools_qwen_coder_0_5b rollout.multi_turn.append=prefill",
}
STAGES = ("gen", "reshard", "reward", "old_log_prob", "ref", "adv", "update_actor", "val")
PASSES = ("old_log_prob", "ref", "update_actor")
MISMATCH = ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "rollout_corr/kl")
PER_STEP = ("critic/score/mean", "response_length/mean", "num_turns/mean", "tool_calls/mean")


def summarize(run_dir: str, skip: int = 1, stages: tuple = STAGES,
              per_step: tuple = MISMATCH + PER_STEP) -> dict:
    """One run's metrics.jsonl -> val curve, medians over the steps after the first `skip` (the
    first step compiles and captures; a resumed run's first step is left out too) of
    `timing_s/<stage>` for each of `stages`, and the `per_step` metrics step by step."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    firsts, seen = set(), set()
    for r in steps:  # a step logged again after a resume: keep the last; a resume's first step out
        if r["step"] in seen or (firsts and r["step"] != max(seen) + 1):
            firsts.add(r["step"])
        seen.add(r["step"])
    by_step = {r["step"]: r for r in steps}
    timed = [r for s, r in sorted(by_step.items()) if s > skip and s not in firsts]
    med = lambda k: statistics.median(r[k] for r in timed if k in r) if any(k in r for r in timed) else None  # noqa: E731
    val = [[r["step"], r[k]] for r in rows for k in r
           if k.startswith("val-core/") and k.endswith("reward/mean@1")]
    return {
        "steps": max(by_step) if by_step else 0,
        "val_accuracy": sorted(dict(val).items()),
        "step_s": med("timing_s/step"),
        "stages_s": {s: med(f"timing_s/{s}") for s in stages if med(f"timing_s/{s}") is not None},
        # each forward / training pass per 200k step tokens: the pass's own speed, apart from
        # how many tokens the variant's samples happened to make
        "pass_s_per_200k_tokens": {s: v for s in PASSES
                                   if (v := per_200k(timed, f"timing_s/{s}")) is not None},
        "steps_timed": len(timed),
        "peak_gb": max((r.get("perf/max_memory_allocated_gb", 0.0) for r in steps), default=None),
        "mismatch_median": {k: med(k) for k in MISMATCH if med(k) is not None},
        "per_step": {k: [[r["step"], r[k]] for r in by_step.values() if k in r]
                     for k in per_step if any(k in r for r in steps)},
        # what the card ran at (gsm8k_h200.sh records it beside each run; none on CPU)
        "gpu_clocks": gpu_clocks.summarise(os.path.join(run_dir, "gpu_clocks.csv")),
        "gpu_monitor": gpu_monitor_medians(timed),
    }


def gpu_monitor_medians(timed: list[dict]) -> dict:
    """The trainer's own record per stage (trainer.gpu_monitor_interval_s): the median over the
    timed steps of each perf/gpu_* metric, e.g. "sm_mhz/update_actor"; empty without it."""
    keys = sorted({k for r in timed for k in r if k.startswith("perf/gpu_")})
    return {k[len("perf/gpu_"):]: statistics.median(r[k] for r in timed if k in r) for k in keys}


def paired(base_scores: str, scores: str) -> list[dict]:
    from gsm8k_report import paired_by_step

    return paired_by_step(scores, base_scores)  # a = the variant, b = base


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="a folder with one sub-folder per variant "
                    "(metrics.jsonl, val_scores.jsonl), as `gsm8k_h200.sh variant` leaves them")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = {"variants": {}, "overrides": VARIANTS}
    for name in VARIANTS:
        d = os.path.join(args.runs, name)
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            continue
        out["variants"][name] = s = summarize(d)
        base = os.path.join(args.runs, "base", "val_scores.jsonl")
        mine = os.path.join(d, "val_scores.jsonl")
        if name != "base" and os.path.isfile(base) and os.path.isfile(mine):
            s["vs_base_problem_by_problem"] = paired(base, mine)
    if not out["variants"]:
        raise SystemExit(f"--runs {args.runs}: no <variant>/metrics.jsonl for any of {sorted(VARIANTS)}")
    write_json(args.out, out)
    for name, s in out["variants"].items():
        last = s["val_accuracy"][-1] if s["val_accuracy"] else None
        rates = "  ".join(f"{k} {v:.3f}" for k, v in s["pass_s_per_200k_tokens"].items())
        print(f"{name:8s} steps {s['steps']:3d}  step {s['step_s'] or float('nan'):6.2f} s  "
              f"peak {s['peak_gb'] or 0:5.1f} GB  last val {last}"
              + (f"  s per 200k tokens: {rates}" if rates else ""))
    return out


if __name__ == "__main__":
    main()
