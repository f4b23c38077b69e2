"""Out-of-sample check of the cost model on the GSM8K steps, the way a user predicts before a run.

    python benchmarks/varlen_holdout.py --out benchmarks/results/cost_varlen_gsm8k.json

For each family of benchmarks/results/cost/varlen_gsm8k.json (benchmarks/varlen_records.py) the
calibration is fitted on every other record (the 40 fixed-length ones and the other families), and
the family's run is predicted from its trainer config and a probe's lengths, as

    python -m hybridflow.cost --config <overrides> --num-gpus 1 --lengths <probe metrics.jsonl> \\
        --calibration <that fit>

- GRPO today (gsm8k_step_h200.json, the recipe as written: 4.77 s): config
  experiment=gsm8k_qwen_coder_0_5b; lengths from the GRPO probe run beside the DAPO run (12 steps,
  another code version, the same model and data: a probe's lengths, not this run's);
- GRPO of 2026-12-04 (gsm8k_graphs_h200/full: 3.87 s, varlen packed attention): the recipe as
  written; lengths from the first 12 steps of the recipe's 60-step run of an earlier stop (another
  run, before this one). VARLEN_MASKED_SHARE (cost.varlen) was chosen on this family's records, so
  its hold-out is out of sample for every fitted coefficient but that one;
- the same with LoRA (gsm8k_graphs_h200/lora: 4.26 s, rank 32 on every linear), from the same
  probe (a full-parameter run's lengths; the LoRA run's responses were ~9% longer), its family
  held out: the LoRA time terms as the update benchmark alone fitted them;
- DAPO (gsm8k_dapo_h200.json, the mean of steps 2-40): config experiment=gsm8k_qwen_coder_0_5b
  algo=dapo with the run's options and the code's options of then; lengths and dynamic-sampling
  rounds from its first 5 steps (a 5-step probe of DAPO itself: how many prompt batches dynamic
  sampling draws is the run's own).
The probes' metrics.jsonl come from git history (varlen_records.RAW). Records the calibration of
each hold-out, the predicted and measured stages, and the commands.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402
from benchmarks.varlen_records import RAW, RAW_COMMIT, raw_metrics  # noqa: E402
from hybridflow.cost.calibrate import fit, load_records  # noqa: E402
from hybridflow.cost.estimate import estimate_step_time  # noqa: E402
from hybridflow.cost.from_overrides import from_overrides  # noqa: E402
from hybridflow.cost.gpus import get_gpu  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = ["experiment=gsm8k_qwen_coder_0_5b"]
THEN = ["rollout.decode_kernels=torch", "rollout.compile_decode=false",
        "parallel.fused_elementwise=false", "parallel.gradient_accumulation_fusion=false",
        "algo.packed_attention=flex"]
THEN_KERNELS = ["algo.packed_attention=varlen", "rollout.kernel_options.fused_sampler=false"]
# what every one of these runs had and today's defaults change: each decode row read every K/V
# column, no speculative tail, the update eager (a LoRA update now defaults to CUDA graphs)
THEN_ROLLOUT = ["rollout.kernel_options.own_columns_only=false", "rollout.speculative.enable=false",
                "parallel.train_cuda_graphs=false"]
CASES = {
    # (that run's packed passes ran flex_attention: varlen became the default after it)
    "grpo_now": {"overrides": RECIPE + THEN_ROLLOUT + ["algo.packed_attention=flex",
                                                       THEN_KERNELS[1]],
                 "probe": ("probe", None),
                 "record": "gsm8k-grpo-now-recipe"},
    # (these ran FlashAttention-2 varlen and drew by the exponential race, as every calibration
    # record did: the fused sampler off costs the race)
    "grpo_today": {"overrides": RECIPE + THEN_ROLLOUT + THEN_KERNELS,
                   "probe": ("benchmarks/results/gsm8k_lora_h200/base/metrics.jsonl", 12),
                   "record": "gsm8k-grpo-today-recipe"},
    # the same family's LoRA run (rank 32, the recipe's LoRA settings), from the same probe
    "grpo_today_lora": {"family": "grpo_today",
                        "overrides": RECIPE + THEN_ROLLOUT + THEN_KERNELS + [
                            "actor.lora.rank=32", "actor.lora.alpha=64", "actor_optim.lr=5e-5"],
                        "probe": ("benchmarks/results/gsm8k_lora_h200/base/metrics.jsonl", 12),
                        "record": "gsm8k-grpo-today-lora"},
    "dapo": {"overrides": RECIPE + THEN_ROLLOUT + ["algo=dapo", "algo.use_kl_loss=false",
                                    "reward.overlong_buffer.len=256", "rollout.max_batch_size=1536"]
             + THEN, "probe": ("dapo", 5), "record": "gsm8k-dapo-then"},
}


def run(out: str) -> dict:
    records = load_records(sorted(os.path.join(ROOT, "benchmarks/results/cost", f)
                                  for f in os.listdir(os.path.join(ROOT, "benchmarks/results/cost"))
                                  if f.endswith(".json")))
    free = get_gpu("H200").memory_gib
    result = {"benchmark": "cost model, GSM8K steps predicted out of sample from a probe's lengths",
              "machine": machine(), "versions": versions("numpy"), "command": command(),
              "raw_commit": RAW_COMMIT, "cases": {}}
    for name, case in CASES.items():
        family = case.get("family", name)
        calib = fit([r for r in records if r.get("family") != family])
        measured = next(r for r in records if r["name"] == case["record"])["metrics"]
        key, steps = case["probe"]
        if key in RAW:
            probe = raw_metrics(key)
            where = f"{RAW[key]} at {RAW_COMMIT}"
        else:  # a run in the working tree
            probe = [r for r in map(json.loads, open(os.path.join(ROOT, key)))
                     if "timing_s/step" in r]
            where = key
        probe = probe[:steps] if steps else probe
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write("".join(json.dumps(r) + "\n" for r in probe))
        try:
            model, plan, fields, _ = from_overrides(case["overrides"], world_size=1,
                                                    free_gib=free, lengths_path=f.name)
        finally:
            os.unlink(f.name)
        pred = estimate_step_time(model=model, gpu="H200", num_gpus=1, layout=plan,
                                  calibration=calib, **fields)
        stages = {k: v for k, v in pred.items()}
        rows = {}
        for k, v in measured.items():
            stage = k.split("/", 1)[1]
            if stage in stages:
                rows[stage] = {"measured": v, "predicted": stages[stage],
                               "error_pct": 100 * (stages[stage] - v) / v}
        result["cases"][name] = {
            "record": case["record"], "family": family, "overrides": case["overrides"],
            "probe": where + (f", steps 1-{steps}" if steps else ""),
            "calibration_without_family": calib.to_dict(),
            "workload": {k: v for k, v in fields.items()
                         if k not in ("response_lengths", "response_len")}
            | {"response_len_mean": sum(fields["response_lengths"]) / len(fields["response_lengths"]),
               "response_len_max": max(fields["response_lengths"])},
            "stages": rows, "other_predicted": stages.get("other")}
        print(f"{name}: " + ", ".join(f"{s} {r['measured']:.2f}/{r['predicted']:.2f} "
                                        f"({r['error_pct']:+.1f}%)" for s, r in rows.items()))
    write_json(out, result)
    print(f"wrote {out}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    run(ap.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
