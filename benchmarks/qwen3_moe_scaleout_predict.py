"""The cost model's layout (TP / EP / PP), step time, tokens/s/GPU and memory per GPU for
Qwen3-30B-A3B GRPO (hybridflow/conf/model/qwen3_moe_30b_a3b.yaml) on 8 and 32 H100s and H200s, in the
shape of NeMo-RL's published run, beside its 1,102 tokens/s/GPU on 32 H100s.

  python benchmarks/qwen3_moe_scaleout_predict.py --out benchmarks/results/qwen3_moe_scaleout_predictions.json

The workload is an assumption (NeMo-RL's exact batch is not restated here): 512 prompts x 16
samples per step, 256-token prompts, every response 4,096 tokens (forced lengths: the decode runs
to the end), one mini-batch, one PPO epoch, a KL reference. The training micro-batch (1, 2 or 4
sequences; the forward-only one twice that) is searched with the layout, as the trainer's automatic
token budgets would pick the largest that fits. Two expert paths: `sequential` is megatron-core's
SequentialMLP, what the one MoE calibration record measured (no transformer-engine in that image);
`grouped` is transformer-engine's grouped GEMM (moe_grouped_gemm: no per-expert cost in training).
Either way hybridflow's generator runs every expert in the CUDA-graph decode
(Calibration.expert_decode_s per expert per layer per step), which is most of the step.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# this checkout's hybridflow, not an installed one
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from run_record import command, versions, write_json  # noqa: E402

from hybridflow.cost import estimate_cost  # noqa: E402

MODEL = "qwen3_moe_30b_a3b"
PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 512, 16, 256, 4096
MICRO_ROWS = (1, 2, 4)           # sequences per update micro-batch tried; forward: twice that
NEMO_RL = {"tokens_per_s_per_gpu": 1102, "gpus": 32, "gpu": "H100",
           "source": "NeMo-RL performance summary, Qwen3-30B-A3B GRPO, Megatron backend"}
NOT_VALIDATED = ("the cost model's MoE terms rest on one record (qwen3_moe_2b, 16 experts, one H200, "
                 "micro-batches of every row); 128 experts, 30B, EP > 1, all-to-all, more than one "
                 "GPU and more than one node are extrapolation; the H100 uses the H200's fitted "
                 "efficiencies")


def workload(gpu: str, num_gpus: int, micro_rows: int, grouped: bool) -> dict:
    seq = PROMPT_LEN + RESPONSE_LEN
    return dict(model=MODEL, gpu=gpu, num_gpus=num_gpus, algorithm="grpo", prompts_per_step=PROMPTS,
                samples_per_prompt=SAMPLES, prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN,
                micro_batch_tokens=micro_rows * seq, forward_micro_batch_tokens=2 * micro_rows * seq,
                moe_grouped_gemm=grouped)


def cli(w: dict, layout: dict) -> str:
    s = (f"python -m hybridflow.cost --model {w['model']} --gpu {w['gpu']} --num-gpus {w['num_gpus']} "
         f"--algorithm grpo --prompts-per-step {w['prompts_per_step']} --samples-per-prompt "
         f"{w['samples_per_prompt']} --prompt-len {w['prompt_len']} --response-len {w['response_len']} "
         f"--micro-batch-tokens {w['micro_batch_tokens']} "
         f"--forward-micro-batch-tokens {w['forward_micro_batch_tokens']}")
    s += " --moe-grouped-gemm" if w["moe_grouped_gemm"] else ""
    s += f" --tp {layout['tp']} --pp {layout['pp']} --ep {layout.get('ep', 1)}"
    s += " --offload-ref" if layout["offload_ref"] else ""
    return s + (" --recompute" if layout["recompute"] else "") + " --json"


def predict(gpu: str, num_gpus: int, grouped: bool) -> dict:
    """The fastest fitting (layout, micro-batch) of the search."""
    best, first = None, None
    for rows in MICRO_ROWS:
        w = workload(gpu, num_gpus, rows, grouped)
        r = estimate_cost(**w)
        first = first or r
        if r.fits and (best is None or r.step_seconds < best[1].step_seconds):
            best = (w, r, rows)
    if best is None:
        return {"gpu": gpu, "num_gpus": num_gpus, "experts": "grouped" if grouped else "sequential",
                "fits": False, "peak_memory_gib": round(first.peak_memory_gib, 1),
                "least_overflowing_layout": first.layout, "suggestions": first.suggestions}
    w, r, rows = best
    lay = r.layout
    return {"gpu": gpu, "num_gpus": num_gpus, "experts": "grouped" if grouped else "sequential",
            "fits": True, "layout": lay, "tp": lay["tp"], "ep": lay.get("ep", 1), "pp": lay["pp"],
            "micro_batch_seqs": rows, "forward_micro_batch_seqs": 2 * rows,
            "step_s": round(r.step_seconds, 1), "tokens_per_step": r.tokens_per_step,
            "tokens_per_s_per_gpu": round(r.throughput, 1),
            "vs_nemo_rl": round(r.throughput / NEMO_RL["tokens_per_s_per_gpu"], 3),
            "peak_memory_gib": round(r.peak_memory_gib, 1), "peak_phase": r.peak_phase,
            "memory_gib": {k: round(v, 2) for k, v in r.memory_gib.items()},
            "stages_s": {k: round(v, 1) for k, v in r.stage_seconds.items()},
            "command": cli(w, lay)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="8,32")
    ap.add_argument("--out")
    a = ap.parse_args()
    rec = {"what": "cost-model forecast, Qwen3-30B-A3B GRPO in NeMo-RL's workload shape",
           "workload": {"model": MODEL, "algorithm": "grpo", "prompts_per_step": PROMPTS,
                        "samples_per_prompt": SAMPLES, "prompt_tokens": PROMPT_LEN,
                        "response_tokens_forced": RESPONSE_LEN, "mini_batches_per_step": 1,
                        "assumption": "NeMo-RL's batch shape is assumed, not restated from its recipe"},
           "throughput_formula": "tokens (prompt + response) / (step seconds x GPUs), as NeMo-RL",
           "peer": NEMO_RL, "not_validated": NOT_VALIDATED,
           "command": command(), "versions": versions(),
           "predictions": [predict(gpu, int(n), grouped) for gpu in ("H100", "H200")
                           for n in a.gpus.split(",") for grouped in (False, True)]}
    for p in rec["predictions"]:
        if not p["fits"]:
            print(f"{p['num_gpus']:>3} x {p['gpu']} {p['experts']:<10} does not fit (peak "
                  f"{p['peak_memory_gib']} GiB); " + "; ".join(p["suggestions"][1:]))
            continue
        print(f"{p['num_gpus']:>3} x {p['gpu']} {p['experts']:<10} TP={p['tp']} EP={p['ep']} PP={p['pp']} "
              f"mb={p['micro_batch_seqs']}  {p['step_s']:8.1f} s  {p['tokens_per_s_per_gpu']:7.0f} "
              f"tok/s/GPU ({p['vs_nemo_rl']:.2f}x NeMo-RL's {NEMO_RL['tokens_per_s_per_gpu']})  "
              f"{p['peak_memory_gib']:6.1f} GiB at {p['peak_phase']}")
    if a.out:
        write_json(a.out, rec)


if __name__ == "__main__":
    main()
