"""One GRPO step and one PPO step on one GPU, per-stage timing (issue: the RL loop on the H200).

Qwen2-0.5B shape (random init, bf16), 8 prompts x 8 samples, prompts of ~128 tokens (synthetic `copy`
task, char tokenizer), 256 response tokens forced (`rollout.ignore_eos`). Each algorithm runs as its
own `python -m hybridflow.train` for `--steps` steps; step 1 (CUDA-graph capture, allocator warm-up)
is reported separately and the per-stage times are medians of the later steps. The JSON also holds
records in the cost model's calibration format (hybridflow/cost/calibrate.py).

  python benchmarks/bench_rl_step.py --out benchmarks/results/rl_step_h200.json

`--dynamic-bsz TOKENS` runs micro-batches by token budget (algo.use_dynamic_bsz, TOKENS per training
micro-batch; `--dynamic-bsz-forward TOKENS` for forward-only passes, default the same) instead of
`--micro` / `--fmicro` sequences; the record's micro-batch tokens are then the budgets.
The old_log_prob pass runs and is timed unless `--skip-old-log-prob` (with one mini-batch per step
the trainer would skip it by default: algo.skip_redundant_old_log_prob).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(algo: str, args, workdir: str) -> list[dict]:
    out_dir = os.path.join(workdir, algo)
    overrides = [f"model={args.model}", f"algo={algo}", "data.synthetic=copy",
                 "data.synthetic_size=256", "data.max_prompt_length=160",
                 f"data.prompts_per_step={args.prompts}", f"rollout.n={args.samples}",
                 f"rollout.max_new_tokens={args.response}", "rollout.ignore_eos=true",
                 "trainer.precision=bf16", f"trainer.total_steps={args.steps}",
                 "trainer.sft_warmup_steps=0", "trainer.resume=false", "trainer.save_final=false",
                 "trainer.progress_bar=false", "trainer.tensorboard=false",
                 f"trainer.output_dir={out_dir}", f"algo.ppo_mini_batch_size={args.prompts * args.samples}",
                 f"algo.micro_batch_size_per_gpu={args.micro}", "reward.fn=math_exact",
                 "trainer.probe_steps=0", f"parallel.tensor_parallel_size={args.tp}",
                 f"parallel.sequence_parallel={str(args.tp > 1).lower()}",
                 f"rollout.tensor_parallel_size={args.tp_gen or args.tp}"]
    if args.fmicro:
        overrides.append(f"algo.forward_micro_batch_size_per_gpu={args.fmicro}")
    if args.dynamic_bsz:
        overrides += ["algo.use_dynamic_bsz=true",
                      f"algo.max_tokens_per_micro_batch_per_gpu={args.dynamic_bsz}"]
        if args.dynamic_bsz_forward:
            overrides.append(
                f"algo.forward_max_tokens_per_micro_batch_per_gpu={args.dynamic_bsz_forward}")
    if not args.skip_old_log_prob:  # every stage timed, as the cost model's records expect
        overrides.append("algo.skip_redundant_old_log_prob=false")
    if args.recompute:
        overrides.append("parallel.activation_checkpointing=true")
    overrides += [f"trainer.gc_interval={args.gc_interval}", *args.override]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                     "--master_addr", "127.0.0.1", "--master_port", str(args.port)]
    subprocess.run([*launcher, "-m", "hybridflow.train", *overrides], check=True, env=env,
                   cwd=ROOT)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(rows: list[dict]) -> dict:
    later = rows[1:] or rows
    keys = sorted({k for r in later for k in r if k.startswith(("timing_s/", "perf/"))})
    med = {k: statistics.median(r[k] for r in later if k in r) for k in keys}
    spread = {k: [min(r[k] for r in later if k in r), max(r[k] for r in later if k in r)]
              for k in keys if k.startswith("timing_s/")}
    return {"first_step": {k: v for k, v in rows[0].items() if k.startswith("timing_s/")},
            "median_later_steps": med, "min_max_later_steps": spread, "steps": rows}


def _override(overrides: list, key: str, default: str) -> str:
    """The value of `key=...` among the Hydra overrides (the last one wins), else `default`."""
    vals = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    return vals[-1] if vals else default


def _override_int(overrides: list, key: str, default: int = 0) -> int:
    return int(_override(overrides, key, str(default)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_0_5b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=7, help="steps per run; step 1 is reported apart")
    ap.add_argument("--algos", default="grpo,ppo")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--fmicro", type=int, default=None, help="forward-only micro-batch size")
    ap.add_argument("--dynamic-bsz", dest="dynamic_bsz", type=int, default=None, metavar="TOKENS",
                    help="micro-batches by token budget: TOKENS per training micro-batch per GPU")
    ap.add_argument("--dynamic-bsz-forward", dest="dynamic_bsz_forward", type=int, default=None,
                    metavar="TOKENS", help="token budget of forward-only passes (default: "
                    "--dynamic-bsz)")
    ap.add_argument("--skip-old-log-prob", dest="skip_old_log_prob", action="store_true",
                    help="let the trainer skip the redundant old_log_prob pass (one mini-batch per "
                    "step: algo.skip_redundant_old_log_prob); default: run and time it")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tp-gen", dest="tp_gen", type=int, default=None)
    ap.add_argument("--gc-interval", dest="gc_interval", type=int, default=1)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--recompute", action="store_true",
                    help="parallel.activation_checkpointing=true (the cost model's recompute layouts)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results, records = {}, []
    kernels = _override(args.override, "rollout.decode_kernels", "auto")
    fused = _override(args.override, "parallel.fused_elementwise", "true") == "true"
    graphs = _override(args.override, "parallel.train_cuda_graphs", "false") == "true"
    wgrad_fusion = _override(args.override, "parallel.gradient_accumulation_fusion",
                             "true") == "true"
    offload_ref = _override(args.override, "trainer.offload_ref", "false") == "true"
    recompute = args.recompute or _override(args.override, "parallel.activation_checkpointing",
                                            "false") == "true"
    with tempfile.TemporaryDirectory() as work:
        for algo in args.algos.split(","):
            results[algo] = summarize(run(algo, args, work))
            m = results[algo]["median_later_steps"]
            tag = f"-tp{args.tp}g{args.tp_gen or args.tp}" if args.nproc > 1 else ""
            seq_len = 128 + args.response
            train_tokens = args.micro * seq_len
            fwd_tokens = (args.fmicro or args.micro) * seq_len
            tag += f"-p{args.prompts}n{args.samples}r{args.response}" + ("-rc" if recompute else "")
            chunk = _override_int(args.override, "parallel.lm_head_chunk_tokens")
            tag += f"-lmc{chunk}" if chunk else ""
            if args.dynamic_bsz:
                train_tokens = args.dynamic_bsz
                fwd_tokens = args.dynamic_bsz_forward or args.dynamic_bsz
                tag += f"-dyn{train_tokens}f{fwd_tokens}"
            else:
                tag += f"-mb{args.micro}f{args.fmicro or args.micro}"
            if kernels == "auto":  # the generator's resolution (these models' head_dim: 64, 128),
                import torch  # after the runs (this process touches no GPU before them)

                kernels = "triton" if torch.cuda.is_available() else "torch"
            tag += ("-tk" if kernels == "triton" else "") + ("" if fused else "-unfused")
            tag += ("-graphs" if graphs else "") + ("-offref" if offload_ref else "")
            records.append({"name": f"{args.model}-{args.nproc}xH200-{algo}{tag}", "config": {
                "model": args.model, "gpu": "H200", "num_gpus": args.nproc,
                "layout": {"tp": args.tp, "pp": 1, "dp": args.nproc // args.tp,
                           "tp_gen": args.tp_gen or args.tp, "offload_ref": offload_ref,
                           "recompute": recompute},
                "algorithm": algo, "prompts_per_step": args.prompts,
                "samples_per_prompt": args.samples, "prompt_len": 128,
                "response_len": args.response, "ppo_epochs": 1, "mini_batches": 1,
                "micro_batch_tokens": train_tokens, "forward_micro_batch_tokens": fwd_tokens,
                "dynamic_bsz": bool(args.dynamic_bsz), "skip_old_log_prob": args.skip_old_log_prob,
                "use_reference": algo == "grpo", "prefill_once_per_prompt": True,
                "response_logits_only": True, "bf16_logits": True,
                "keep_generator": "rollout.free_cache_engine=false" in args.override,
                "lm_head_chunk_tokens": chunk,
                "decode_kernels": kernels,
                "fused_elementwise": fused,
                "train_cuda_graphs": graphs,
                "gradient_accumulation_fusion": wgrad_fusion,
                "compile_decode": "rollout.compile_decode=true" in args.override},
            "metrics": m})
    import torch

    record = {"benchmark": "RL step per-stage timing", "model": args.model,
              "machine": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "host": platform.node()},
              "versions": {"torch": torch.__version__, "python": platform.python_version()},
              "command": " ".join(["python"] + sys.argv), "results": results, "records": records}
    stages = ["reshard", "gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic",
              "update_actor", "step"]
    print(f"{'stage':16s}" + "".join(f"{a:>10s}" for a in results))
    for s in stages:
        print(f"{s:16s}" + "".join(
            f"{results[a]['median_later_steps'].get('timing_s/' + s, float('nan')):10.3f}"
            for a in results))
    for a in results:
        m = results[a]["median_later_steps"]
        print(a, "throughput tok/s/GPU", round(m.get("perf/throughput", 0)), "peak GB",
              round(m.get("perf/max_memory_allocated_gb", 0), 1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
