"""The cost model's layout, runner-up and forecast for the scale-out workload (hybridflow/conf/experiment/
scaleout_8b.yaml:
Llama-3-8B shape, GRPO, 4 prompts per GPU x 32 samples, 150 + 1,000 forced tokens, 4 mini-batches,
micro-batches of 4 / 8 sequences) on 2, 8 and 16 H200s; tokens/s/GPU = tokens / (step s x GPUs).

  python benchmarks/scaleout_8b_predict.py --out benchmarks/results/scaleout_8b_predictions.json

`workload(num_gpus)` is also what benchmarks/scaleout_8b.sh puts beside each measured run.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# this checkout's hybridflow, not an installed one
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from run_record import command, versions, write_json  # noqa: E402

from hybridflow.cost import estimate_cost  # noqa: E402

PROMPT_LEN, RESPONSE_LEN, SAMPLES, PROMPTS_PER_GPU, MINI_BATCHES = 150, 1000, 32, 4, 4
MICRO, FORWARD_MICRO = 4, 8   # sequences per update / forward-only micro-batch (the config's)
NOT_VALIDATED = ("the cost model was validated (leave-one-out within 15%) only on 1-2 H200s, PP=1, "
                 "one mini-batch, models up to 7B (docs/cost_model.md): PP > 1, 4 "
                 "mini-batches, 8B, more than 2 GPUs and more than one node (16 GPUs) are extrapolation")


def workload(num_gpus: int) -> dict:
    seq = PROMPT_LEN + RESPONSE_LEN
    return dict(model="llama3_8b", gpu="H200", num_gpus=num_gpus, algorithm="grpo",
                prompts_per_step=PROMPTS_PER_GPU * num_gpus, samples_per_prompt=SAMPLES,
                prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN, mini_batches=MINI_BATCHES,
                micro_batch_tokens=MICRO * seq, forward_micro_batch_tokens=FORWARD_MICRO * seq)


def cli(w: dict, layout: dict | None = None) -> str:
    s = (f"python -m hybridflow.cost --model {w['model']} --gpu {w['gpu']} --num-gpus {w['num_gpus']} "
         f"--algorithm grpo --prompts-per-step {w['prompts_per_step']} --samples-per-prompt "
         f"{w['samples_per_prompt']} --prompt-len {w['prompt_len']} --response-len {w['response_len']} "
         f"--mini-batches {w['mini_batches']} --micro-batch-tokens {w['micro_batch_tokens']} "
         f"--forward-micro-batch-tokens {w['forward_micro_batch_tokens']}")
    if layout:
        s += f" --tp {layout['tp']} --pp {layout['pp']} --tp-gen {layout['tp_gen']}"
    return s + " --json"


def summary(report, layout: dict | None = None) -> dict:
    """One layout's forecast; `layout` forces it (the runner-up is re-estimated alone for its stages)."""
    return {"layout": report.layout, "fits": report.fits, "step_s": round(report.step_seconds, 2),
            "tokens_per_s_per_gpu": round(report.throughput, 1),
            "peak_memory_gib": round(report.peak_memory_gib, 1), "peak_phase": report.peak_phase,
            "stages_s": {k: round(v, 2) for k, v in report.stage_seconds.items()},
            "command": cli(report.workload | {"model": report.model, "gpu": report.gpu,
                                              "num_gpus": report.num_gpus}, layout)}


def predict(num_gpus: int) -> dict:
    w = workload(num_gpus)
    best = estimate_cost(**w)
    out = {"num_gpus": num_gpus, "tokens_per_step": best.tokens_per_step,
           "recommended": summary(best)}
    out["recommended"]["command"] = cli(w)
    if best.runners_up:
        lay = best.runners_up[0]["layout"]
        forced = {k: lay[k] for k in ("tp", "pp", "tp_gen", "offload_ref", "recompute")}
        out["runner_up"] = summary(estimate_cost(**w, layout=forced), lay)
    caveats = []
    for k in ("recommended", "runner_up"):
        if k in out and out[k]["layout"]["pp"] > 1:
            caveats.append(f"{k} has PP={out[k]['layout']['pp']}: the pipeline bubble and p2p terms "
                           "were never fitted to a GPU measurement (PP > 1 has only run on CPU/gloo)")
    if num_gpus > 8:
        caveats.append("more than one node (8 GPUs per node): inter-node DP/PP bandwidth is the "
                       "gpus.py default, never measured; the driver runs one node only")
    out["caveats"] = caveats
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="2,8,16")
    ap.add_argument("--out")
    a = ap.parse_args()
    rec = {"what": "cost-model forecast, the scale-out workload (hybridflow/conf/experiment/scaleout_8b.yaml)",
           "workload": {"model": "llama3_8b (random weights, bf16)", "algorithm": "grpo",
                        "prompts_per_gpu": PROMPTS_PER_GPU, "samples_per_prompt": SAMPLES,
                        "prompt_tokens": PROMPT_LEN, "response_tokens_forced": RESPONSE_LEN,
                        "mini_batches_per_step": MINI_BATCHES, "micro_batch_seqs": MICRO,
                        "forward_micro_batch_seqs": FORWARD_MICRO},
           "throughput_formula": "tokens (prompt + response) / (step seconds x GPUs), as NeMo-RL and verl",
           "peer": {"nemo_rl_v0.5_16xH100_tokens_per_s_per_gpu": 1581, "step_s": 92.8},
           "not_validated": NOT_VALIDATED,
           "command": command(), "versions": versions(),
           "predictions": [predict(int(n)) for n in a.gpus.split(",")]}
    for p in rec["predictions"]:
        for k in ("recommended", "runner_up"):
            if k in p:
                r = p[k]
                lay = r["layout"]
                print(f"{p['num_gpus']:>3} {k:<12} TP={lay['tp']} PP={lay['pp']} DP={lay['dp']} "
                      f"TPg={lay['tp_gen']}  {r['step_s']:7.2f} s  {r['tokens_per_s_per_gpu']:8.0f} "
                      f"tok/s/GPU  {r['peak_memory_gib']:6.1f} GiB")
    if a.out:
        write_json(a.out, rec)


if __name__ == "__main__":
    main()
