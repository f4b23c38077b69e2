"""One RL step per algorithm (GRPO and PPO by default), per-stage timing.

Workload: a Qwen2 shape (`--model`, random init), 8 prompts x 8 samples, prompts of 128 tokens
(synthetic `copy` task, char tokenizer), 256 response tokens forced (`rollout.ignore_eos`), one
mini-batch (one optimizer step) per step. Each algorithm runs as its own `python -m hybridflow.train`
for `--steps` steps; step 1 (CUDA-graph capture, compilation, allocator warm-up) is reported apart and
the per-stage times are medians of the later steps.

Configuration: with no flags the trainer runs on the product's defaults, the auto options decided
for the device at start-up (hybridflow/config_auto.py). `--speed` applies the configuration of the
speed results instead (SPEED below; the micro-batches of all the step's sequences unless `--micro` /
`--fmicro`); `--override k=v` (repeatable) comes last and wins.

  python benchmarks/bench_rl_step.py --out benchmarks/results/rl_step_h200.json
  python benchmarks/bench_rl_step.py --model qwen2_1_5b --algos grpo --speed --out /tmp/rl.json
  python benchmarks/bench_rl_step.py --model tiny --prompts 2 --samples 4 --response 8 --steps 2 \
      --algos grpo --out /tmp/rl.json                                   # CPU smoke

The JSON also holds one record per algorithm in the cost model's calibration format
(hybridflow/cost/calibrate.py), its config read from the trainer's resolved configuration (the
automatic token budgets from the trainer's `auto:` line). `--old-log-prob` runs and times the
old_log_prob pass even where it is redundant (the cost model's records time every stage).
"""

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from run_record import command, machine, versions, write_json  # noqa: E402

# The speed results' trainer options (vs_trl_h200.json, ours; rl_step_h200.json's workload), stated
# in full so that the auto defaults decide none of them; with the two micro-batch sizes, eight.
SPEED = ("trainer.precision=bf16",
         "algo.use_dynamic_bsz=false",        # micro-batches of rows, not token budgets + packing
         "rollout.free_cache_engine=false",   # generator, KV cache and decode graphs kept across steps
         "rollout.decode_kv_window=64",       # decode attention over the written KV columns, by 64
         "rollout.decode_kernels=triton",
         "rollout.compile_decode=true")
PROMPT_LETTERS = 120  # the copy task's default: 120 letters + 8 tokens = 128-token prompts
AUTO_BUDGETS = re.compile(r"auto: token budgets per micro-batch: (.*?) tokens")
# the generator freed where keeping it would starve the update (config_auto.size_for_memory)
AUTO_FREED = "auto: rollout.free_cache_engine=true"
STAGES = ["reshard", "gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic",
          "update_actor", "step"]


def overrides(algo: str, args, out_dir: str) -> list[str]:
    """The trainer's Hydra overrides: the workload, then --speed, --micro/--fmicro and the other
    flags that were given, then --override."""
    rows = args.prompts * args.samples
    out = [f"model={args.model}", f"algo={algo}", "data.synthetic=copy", "data.synthetic_size=256",
           "data.max_prompt_length=160", f"data.prompts_per_step={args.prompts}", f"rollout.n={args.samples}",
           f"rollout.max_new_tokens={args.response}", "rollout.ignore_eos=true", "reward.fn=math_exact",
           f"algo.ppo_mini_batch_size={rows}", f"trainer.total_steps={args.steps}", "trainer.resume=false",
           "trainer.save_final=false", "trainer.progress_bar=false", "trainer.tensorboard=false",
           f"trainer.output_dir={out_dir}"]
    if args.tp > 1 or args.tp_gen:
        out += [f"parallel.tensor_parallel_size={args.tp}", f"parallel.sequence_parallel={str(args.tp > 1).lower()}",
                f"rollout.tensor_parallel_size={args.tp_gen or args.tp}"]
    if args.speed:
        out += list(SPEED)
    micro, fmicro = args.micro or (rows if args.speed else None), args.fmicro or (rows if args.speed else None)
    if micro:
        out.append(f"algo.micro_batch_size_per_gpu={micro}")
    if fmicro:
        out.append(f"algo.forward_micro_batch_size_per_gpu={fmicro}")
    if args.dynamic_bsz:
        out += ["algo.use_dynamic_bsz=true", f"algo.max_tokens_per_micro_batch_per_gpu={args.dynamic_bsz}",
                f"algo.forward_max_tokens_per_micro_batch_per_gpu={args.dynamic_bsz_forward or args.dynamic_bsz}"]
    if args.old_log_prob:
        out.append("algo.skip_redundant_old_log_prob=false")
    if args.recompute:
        out.append("parallel.activation_checkpointing=true")
    if args.gc_interval is not None:
        out.append(f"trainer.gc_interval={args.gc_interval}")
    return out + args.override


def run(algo: str, args, workdir: str) -> tuple[list[dict], list[str], dict]:
    """(metrics rows, overrides, the token budgets the trainer chose where they were auto). The
    overrides returned also hold rollout.free_cache_engine=true when the trainer chose it (its
    `auto:` line): the config as the trainer ran it."""
    out_dir = os.path.join(workdir, algo)
    ovr = overrides(algo, args, out_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                     "--master_addr", "127.0.0.1", "--master_port", str(args.port)]
    budgets = {}
    with subprocess.Popen([*launcher, "-m", "hybridflow.train", *ovr], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:  # echoed as it comes; the auto budgets read on the way
            sys.stdout.write(line)
            if AUTO_FREED in line:
                ovr = [*ovr, "rollout.free_cache_engine=true"]
            m = AUTO_BUDGETS.search(line)
            if m:
                for part in m.group(1).split(","):
                    kind, tokens = part.split()
                    key = "forward_max_tokens_per_micro_batch_per_gpu" if kind == "forward" else \
                        "max_tokens_per_micro_batch_per_gpu"
                    budgets[key] = int(tokens)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], ovr, budgets


def summarize(rows: list[dict]) -> dict:
    later = rows[1:] or rows
    keys = sorted({k for r in later for k in r if k.startswith(("timing_s/", "perf/"))})
    med = {k: statistics.median(r[k] for r in later if k in r) for k in keys}
    spread = {k: [min(r[k] for r in later if k in r), max(r[k] for r in later if k in r)]
              for k in keys if k.startswith("timing_s/")}
    return {"first_step": {k: v for k, v in rows[0].items() if k.startswith("timing_s/")},
            "median_later_steps": med, "min_max_later_steps": spread, "steps": rows}


def calibration_record(algo: str, args, ovr: list[str], budgets: dict, metrics: dict) -> dict:
    """The run as the cost model's calibration reads it: its config resolved as the trainer did."""
    import torch

    from hybridflow.config import load_config
    from hybridflow.config_auto import resolve_auto
    from hybridflow.cost.from_config import workload_fields
    from hybridflow.models.attention import fa4_installed

    on_gpu = torch.cuda.is_available()
    cfg, _ = resolve_auto(load_config(ovr), device_type="cuda" if on_gpu else "cpu")
    a, p, r = cfg.algo, cfg.parallel, cfg.rollout
    if a.use_dynamic_bsz:
        a = dataclasses.replace(a, **budgets)
        cfg = dataclasses.replace(cfg, algo=a)
    if a.use_dynamic_bsz and a.max_tokens_per_micro_batch_per_gpu is None:
        raise RuntimeError("the trainer chose token budgets but printed no 'auto: token budgets' line")
    # auto: the Triton decode layers on a GPU, except for MoE models (dense-only; the generator
    # takes the torch layers)
    kernels = r.decode_kernels if r.decode_kernels != "auto" else \
        ("triton" if on_gpu and not cfg.model.moe.enabled else "torch")
    prompt_len = (cfg.data.synthetic_length or PROMPT_LETTERS) + 8
    rec = workload_fields(cfg, decode_kernels=kernels,
                          lengths=dict(prompt_len=prompt_len, response_len=args.response),
                          fa4_installed=fa4_installed())
    if not a.use_dynamic_bsz:  # every row of the copy task is prompt + response tokens long
        rec.update(micro_batch_tokens=a.micro_batch_size_per_gpu * (prompt_len + args.response),
                   forward_micro_batch_tokens=(a.forward_micro_batch_size_per_gpu or a.micro_batch_size_per_gpu)
                   * (prompt_len + args.response))
    tp_g = r.tensor_parallel_size or p.tensor_parallel_size
    layout = {"tp": p.tensor_parallel_size, "pp": 1, "dp": args.nproc // p.tensor_parallel_size, "tp_gen": tp_g,
              "offload_ref": cfg.trainer.offload_ref, "recompute": p.activation_checkpointing}
    rec.update(model=args.model, gpu="H200", num_gpus=args.nproc, layout=layout,
               dynamic_bsz=bool(a.use_dynamic_bsz), pack_sequences=bool(a.pack_sequences),
               prefill_once_per_prompt=True, response_logits_only=True, bf16_logits=True,
               compile_decode=bool(r.compile_decode), decode_kv_window=r.decode_kv_window,
               compact_finished_rows=bool(r.compact_finished_rows), precision=cfg.trainer.precision)
    tag = f"-tp{p.tensor_parallel_size}g{tp_g}" if args.nproc > 1 else ""
    tag += f"-p{args.prompts}n{args.samples}r{args.response}" + ("-rc" if p.activation_checkpointing else "")
    tag += f"-lmc{p.lm_head_chunk_tokens}" if p.lm_head_chunk_tokens else ""
    if a.use_dynamic_bsz:
        tag += f"-dyn{rec['micro_batch_tokens']}f{rec['forward_micro_batch_tokens']}"
    else:
        tag += f"-mb{a.micro_batch_size_per_gpu}f{a.forward_micro_batch_size_per_gpu or a.micro_batch_size_per_gpu}"
    tag += ("-tk" if kernels == "triton" else "") + ("" if p.fused_elementwise else "-unfused")
    tag += ("-graphs" if p.train_cuda_graphs else "") + ("-offref" if cfg.trainer.offload_ref else "")
    return {"name": f"{args.model}-{args.nproc}xH200-{algo}{tag}", "config": rec, "metrics": metrics}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2_0_5b", help="a hybridflow/conf/model group name")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--steps", type=int, default=7, help="steps per run; step 1 is reported apart")
    ap.add_argument("--algos", default="grpo,ppo")
    ap.add_argument("--speed", action="store_true",
                    help="the speed results' configuration: " + " ".join(SPEED) + " and micro-batches of "
                         "every sequence of the step (unless --micro / --fmicro)")
    ap.add_argument("--micro", type=int, default=None, help="training micro-batch in sequences")
    ap.add_argument("--fmicro", type=int, default=None, help="forward-only micro-batch in sequences")
    ap.add_argument("--dynamic-bsz", dest="dynamic_bsz", type=int, default=None, metavar="TOKENS",
                    help="micro-batches by token budget: TOKENS per training micro-batch per GPU")
    ap.add_argument("--dynamic-bsz-forward", dest="dynamic_bsz_forward", type=int, default=None,
                    metavar="TOKENS", help="token budget of forward-only passes (default: --dynamic-bsz)")
    ap.add_argument("--old-log-prob", dest="old_log_prob", action="store_true",
                    help="run and time the old_log_prob pass even where it is redundant")
    ap.add_argument("--recompute", action="store_true", help="parallel.activation_checkpointing=true")
    ap.add_argument("--gc-interval", dest="gc_interval", type=int, default=None)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tp-gen", dest="tp_gen", type=int, default=None)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--override", action="append", default=[], help="a Hydra override, applied last")
    ap.add_argument("--out", default=None, help="results JSON (written atomically)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: need >= 2 (the first is reported apart)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results, records, runs = {}, [], {}
    with tempfile.TemporaryDirectory() as work:
        for algo in args.algos.split(","):  # no GPU work in this process before the runs
            rows, ovr, budgets = run(algo, args, work)
            results[algo] = summarize(rows)
            runs[algo] = {"overrides": ovr, "auto_token_budgets": budgets}
    for algo in results:
        try:
            records.append(calibration_record(algo, args, runs[algo]["overrides"],
                                              runs[algo]["auto_token_budgets"], results[algo]["median_later_steps"]))
        except (RuntimeError, ValueError) as e:  # the timings are written without their record
            print(f"no calibration record for {algo}: {e}", file=sys.stderr)
            runs[algo]["record_error"] = str(e)
    record = {"benchmark": "RL step per-stage timing", "model": args.model,
              "configuration": "speed" if args.speed else "defaults", "machine": machine(),
              "versions": versions("megatron-core", "transformers"), "command": command(),
              "runs": runs, "results": results, "records": records}
    print(f"{'stage':16s}" + "".join(f"{a:>10s}" for a in results))
    for s in STAGES:
        print(f"{s:16s}" + "".join(
            f"{results[a]['median_later_steps'].get('timing_s/' + s, float('nan')):10.3f}" for a in results))
    for a in results:
        m = results[a]["median_later_steps"]
        print(a, "throughput tok/s/GPU", round(m.get("perf/throughput", 0)), "peak GB",
              round(m.get("perf/max_memory_allocated_gb", 0), 1))
    if args.out:
        write_json(args.out, record)
    return record


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad arguments: one line, no traceback
        sys.exit(f"bench_rl_step.py: error: {e}")
