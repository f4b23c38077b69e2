"""The scale-out run on one node, NeMo-RL's 8B GRPO workload: `torchrun --nproc_per_node N -m
hybridflow.train experiment=scaleout_8b` with prompts per step and the mini-batch scaled to N (4 prompts x 32 samples
per GPU, 4 mini-batches), the layout from the overrides, then one JSON: tokens/s/GPU (tokens /
(step s x GPUs), NeMo-RL's and verl's formula), step seconds, stages, peak memory (medians of the
steps after the first, which captures CUDA graphs), layout, command, and the cost model's forecast
for the same config and layout beside it. Called by benchmarks/scaleout_8b.sh.

  python benchmarks/scaleout_8b.py --nproc 2 --out benchmarks/results/scaleout_8b_h200x2.json [hydra overrides]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_rl_step import summarize  # noqa: E402
from run_record import command, machine, versions, write_json  # noqa: E402

PEER = {"source": "NeMo-RL v0.5 docs/about/performance-summary.md, grpo-llama3.1-8b-instruct-2n8g",
        "gpus": "16 x H100", "tokens_per_s_per_gpu": 1581, "step_s": 92.8}


def forecast(cfg, nproc: int) -> dict:
    """The cost model on the composed config: its workload and layout, as run."""
    from hybridflow.cost import estimate_cost

    p, r, a = cfg.parallel, cfg.rollout, cfg.algo
    seq = cfg.data.max_prompt_length + r.max_new_tokens
    seqs = cfg.data.prompts_per_step * r.n
    layout = {"tp": p.tensor_parallel_size, "pp": p.pipeline_parallel_size,
              "tp_gen": r.tensor_parallel_size or p.tensor_parallel_size,
              "offload_ref": cfg.trainer.offload_ref, "recompute": False}
    try:
        rep = estimate_cost(model=cfg.model.name, gpu="H200", num_gpus=nproc, algorithm="grpo",
                            prompts_per_step=cfg.data.prompts_per_step, samples_per_prompt=r.n,
                            prompt_len=cfg.data.max_prompt_length, response_len=r.max_new_tokens,
                            mini_batches=seqs // a.ppo_mini_batch_size,
                            micro_batch_tokens=a.micro_batch_size_per_gpu * seq,
                            forward_micro_batch_tokens=(a.forward_micro_batch_size_per_gpu
                                                        or a.micro_batch_size_per_gpu) * seq,
                            layout=layout)
    except ValueError as e:
        return {"error": str(e)}
    out = {"step_s": rep.step_seconds, "tokens_per_s_per_gpu": rep.throughput,
           "peak_memory_gib": rep.peak_memory_gib, "stages_s": rep.stage_seconds, "fits": rep.fits}
    if layout["pp"] > 1:
        out["caveat"] = "PP > 1 was never validated against a GPU measurement"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--steps", type=int, default=4, help="step 1 is reported apart")
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", help="output directory of the run (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after the scaled defaults")
    a = ap.parse_args()
    n = a.nproc
    overrides = ["experiment=scaleout_8b", f"data.prompts_per_step={4 * n}",
                 f"algo.ppo_mini_batch_size={32 * n}", f"trainer.total_steps={a.steps}",
                 *a.overrides]
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    cfg = load_config(overrides)
    validate(cfg, world_size=n)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = a.keep or os.path.join(tmp, "run")
        overrides.append(f"trainer.output_dir={out_dir}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
               "--master_addr", "127.0.0.1", "--master_port", str(a.port),
               "-m", "hybridflow.train", *overrides]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    s = summarize(rows)
    m = s["median_later_steps"]
    p = cfg.parallel
    rec = {"benchmark": "scale-out, NeMo-RL's 8B GRPO workload",
           "machine": {**machine(), "num_gpus": n}, "versions": versions("megatron-core"),
           "command": command(), "train_command": " ".join(cmd[1:]),
           "layout": {"tp": p.tensor_parallel_size, "pp": p.pipeline_parallel_size,
                      "dp": n // (p.tensor_parallel_size * p.pipeline_parallel_size),
                      "tp_gen": cfg.rollout.tensor_parallel_size or p.tensor_parallel_size},
           "workload": {"model": cfg.model.name, "prompts_per_step": cfg.data.prompts_per_step,
                        "samples_per_prompt": cfg.rollout.n,
                        "prompt_tokens": cfg.data.max_prompt_length,
                        "response_tokens_forced": cfg.rollout.max_new_tokens,
                        "ppo_mini_batch_size": cfg.algo.ppo_mini_batch_size},
           "tokens_per_s_per_gpu": m.get("perf/throughput"),
           "step_s": m.get("timing_s/step"),
           "stages_s": {k[len("timing_s/"):]: v for k, v in m.items() if k.startswith("timing_s/")},
           "peak_memory_gib": m.get("perf/max_memory_allocated_gb"),
           "tokens_per_step": m.get("perf/total_num_tokens"),
           "first_step_losses": {k: v for k, v in rows[0].items() if k.startswith("actor/")},
           "prediction": forecast(cfg, n), "peer": PEER,
           "steps": s}
    print(json.dumps({k: rec[k] for k in ("layout", "tokens_per_s_per_gpu", "step_s",
                                          "peak_memory_gib", "prediction")}, indent=1))
    write_json(a.out, rec)


if __name__ == "__main__":
    main()
