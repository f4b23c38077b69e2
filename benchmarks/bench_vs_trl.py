r"""Our GRPO step vs TRL 1.16's GRPOTrainer step on the same synthetic workload, one run.

Workloads (random-init weights of our model shape, 8 prompts x 8 samples, 128-token prompts, exactly
256 response tokens, no early stop, temperature 1, KL loss coefficient 0.001, lr 1e-6):
  w1_0_5b  hybridflow/conf/model/qwen2_0_5b.yaml      w1_1_5b  hybridflow/conf/model/qwen2_1_5b.yaml
  gsm8k    the GSM8K experiment (Qwen2.5-Coder-0.5B-Instruct, 64 prompts x 8 samples, up to 1,024
           tokens): not run by this script (both sides take minutes per step of TRL's: device
           calls of their own, below); with `--gsm8k-ours METRICS.jsonl --gsm8k-trl TRL.json
           [--gsm8k-ours-overrides "k=v ..."]` its entry is made from those runs (medians: ours over
           steps 2.., TRL over the steps after the first of each process; at least 3 timed on each
           side; the two configs checked to be the same workload), else copied from
           benchmarks/results/gsm8k_h200.json (ours: its top level, the experiment's run; trl).
           No MFU (variable response lengths).

Each side runs in its own process, one after the other (ours, then TRL; `--sides` picks), so
neither holds GPU memory while the other runs and each peak-memory number is its own process's:
- ours: benchmarks/bench_rl_step.py --algos grpo, `--ours speed` (default: the speed configuration,
  bench_rl_step.SPEED, with micro-batches of `--ours-micro` sequences, default TRL's) or `--ours
  default` (the product's defaults), plus `--ours-options`; the `copy` task with
  `data.synthetic_length` = prompt length - 8. The old-log-prob pass is skipped (one mini-batch per
  step: the trainer's default; TRL has none either). Step and stage times are medians of the steps
  after the first.
- TRL: this file with `--trl-side` (a hidden option), in its fastest configuration that fits the
  GPU, as its users tune it: the HF Qwen2 of the same shape (bench_generate.hf_model) held in fp32 and
  trained under bf16 autocast (`bf16=True`) as trl_gsm8k.py does (pure-bf16 Adam would lose 1e-6
  updates; ours keeps fp32 master weights too; `--trl-weights bf16` holds it in bf16);
  `generation_batch_size` = prompts x samples (the whole step's completions from one `generate`
  call) and `per_device_train_batch_size` `--trl-micro` (default all of them, 64: one update pass
  per step); gradient checkpointing `--trl-grad-ckpt auto` (default): off unless the update does not
  fit without it (trl_gsm8k.probe_update_memory before training; and should training still run out
  of memory, the run is redone with it on), `on` is the configuration of the earlier results. A
  WordLevel tokenizer whose words "t0".."t{V-1}" are the model's ids (eos = pad = the last id, never
  in a prompt) and 8 prompts of prompt-length random words; num_generations 8; `min_new_tokens` =
  `max_completion_length` in generation_kwargs forces every completion to full length (checked from
  TRL's logged completion lengths); loss `dapo`, scale_rewards "group", beta 0.001 (so both sides
  run a reference forward: TRL loads it from the random weights saved to `--workdir`), a random
  reward per completion (non-zero advantages). Step time: on_step_begin -> on_step_end with CUDA
  synchronised; `trl_step_s` is the median of the steps after the first.
MFU of our stages = stage FLOPs / (stage seconds x `--peak-tflops`), FLOPs from hybridflow/cost/flops.py
at the measured tokens: gen = prefill of each distinct prompt once (our generator shares it between
the n samples) + decode at mean context P + R/2; ref and old_log_prob = 1 forward over P + R tokens
per sequence; update_actor = 3 forwards (fwd + bwd; no activation recompute); step = their sum over
the step's seconds. On CPU the MFU numbers are meaningless, computed alike.

CPU smoke (tiny model, a few tokens; tests/dist/test_bench_scripts.py):
  python benchmarks/bench_vs_trl.py --workloads w1_0_5b --model-yaml hybridflow/conf/model/tiny.yaml \
      --device cpu --prompt-len 16 --response 8 --prompts 2 --samples 2 --steps 3 --trl-steps 3 --out /tmp/v.json

On an H200: TRL's side of both w1 workloads in one device call: benchmarks/vs_trl_h200.sh. Ours
(--sides ours) takes ~1.5 min per workload. The JSON is rewritten after each workload, so a cut call
keeps the finished ones; `--append` adds to an existing JSON.

GSM8K in consecutive calls of one warm machine (the GGUF carried in parts and assembled first:
benchmarks/gsm8k_h200.sh setup; carry [".whl", ".whl_bench", ".gsm8k"]):
  1. RUN_DIR=/tmp/gsm8k_vs bash benchmarks/gsm8k_h200.sh train 240 trainer.total_steps=10 \
       trainer.val_every=0 trainer.save_every=0
     (~3 min: model load, 10 steps of ~5-7 s), then in the same call
     MODEL=/tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf PHASES=trl TRL_RESUME=1 TRL_STEPS=4 \
       TRL_ARGS="--lr 3e-6 --weight-decay 0.01" TOTAL_S=330 bash benchmarks/gsm8k_peers.sh
  2. the TRL command again (resumes; each call's first step is its warm-up) until its JSON holds 3
     timed steps (TRL: ~1.5 min load, ~2.5 min for a call's first step, 1-1.5 min after);
  3. python benchmarks/bench_vs_trl.py --workloads "" --append --out benchmarks/results/vs_trl_h200.json \
       --gsm8k-ours $OUT/metrics.jsonl --gsm8k-trl $OUT/trl_gsm8k.json \
       --gsm8k-ours-overrides "trainer.total_steps=10 trainer.val_every=0 trainer.save_every=0"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gsm8k_hf_eval import machine, versions, write_json  # noqa: E402
from run_record import command  # noqa: E402

WORKLOADS = {"w1_0_5b": "hybridflow/conf/model/qwen2_0_5b.yaml", "w1_1_5b": "hybridflow/conf/model/qwen2_1_5b.yaml"}
GSM8K = ROOT / "benchmarks/results/gsm8k_h200.json"  # ours (top level) and trl
FORWARD_STAGES = ("ref", "old_log_prob")


def load_shape(path: str):
    """(group name, ModelConfig) of a hybridflow/conf/model/*.yaml file: ours composes the model group by name."""
    import yaml

    from hybridflow.model_config import ModelConfig

    p = (ROOT / path).resolve() if not os.path.isabs(path) else Path(path)
    if p.parent != (ROOT / "hybridflow/conf/model").resolve() or not p.is_file():
        raise ValueError(f"--model-yaml {path}: expected a file in {ROOT / 'hybridflow/conf/model'} (our trainer "
                         "selects the model group by that name)")
    return p.stem, ModelConfig(**yaml.safe_load(p.read_text()))


# ----------------------------------------------------------------------------------------- ours
# the speed options a CPU cannot run (the CPU smoke): fp32, PyTorch decode, not compiled
CPU_OPTIONS = ["trainer.precision=fp32", "rollout.decode_kernels=torch", "rollout.compile_decode=false"]


def ours_options(args) -> list[str]:
    return args.ours_options.split() + (CPU_OPTIONS if args.device == "cpu" else [])


def run_ours(args, *, model: str, workdir: Path) -> dict:
    out = workdir / "ours.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_rl_step.py"), "--model", model, "--algos", "grpo",
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--response", str(args.response), "--override", f"data.synthetic_length={args.prompt_len - 8}",
           "--override", f"actor_optim.lr={args.lr}", "--out", str(out)]
    if args.ours == "speed":
        cmd += ["--speed", "--micro", str(args.ours_micro), "--fmicro", str(args.ours_micro)]
    for o in ours_options(args):
        cmd += ["--override", o]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return json.loads(out.read_text())


def stage_flops(shape, *, prompts: int, samples: int, prompt_len: float, response: float,
                stages) -> dict[str, float]:
    """Model FLOPs of each of our timed stages (those in `stages`) for one step."""
    from hybridflow.cost.flops import decode_flops_per_token, forward_flops_per_token, train_flops_per_token

    seqs, seq_len = prompts * samples, prompt_len + response
    head = response / seq_len  # logits only where they are scored (hybridflow.engine)
    out = {"gen": prompts * prompt_len * forward_flops_per_token(shape, prompt_len)
           + seqs * response * decode_flops_per_token(shape, prompt_len + response / 2),
           "update_actor": seqs * seq_len * train_flops_per_token(shape, seq_len, recompute=False,
                                                                  head_fraction=head)}
    for s in FORWARD_STAGES:
        out[s] = seqs * seq_len * forward_flops_per_token(shape, seq_len, head_fraction=head)
    return {s: f for s, f in out.items() if s in stages}


def ours_entry(summary: dict, *, shape, args) -> dict:
    med = summary["median_later_steps"]
    stages = {k.removeprefix("timing_s/"): v for k, v in med.items() if k.startswith("timing_s/")}
    later = summary["steps"][1:]
    lengths = {(r["response_length/min"], r["response_length/max"]) for r in summary["steps"]}
    if lengths != {(args.response, args.response)}:
        raise RuntimeError(f"our responses were not all {args.response} tokens: (min, max) {lengths}")
    # the tokens actually run: every sequence is prompt + response (copy task, forced length)
    seqs = args.prompts * args.samples
    response = statistics.median(r["response_length/mean"] for r in later)
    prompt_len = statistics.median(r["perf/total_num_tokens"] for r in later) / seqs - response
    flops = stage_flops(shape, prompts=args.prompts, samples=args.samples, prompt_len=prompt_len,
                        response=response, stages=stages)
    flops["step"] = sum(flops.values())
    peak = args.peak_tflops * 1e12
    mems = [r["perf/max_memory_allocated_gb"] for r in summary["steps"] if "perf/max_memory_allocated_gb" in r]
    return {"ours_step_s": stages["step"], "ours_step_s_all": [r["timing_s/step"] for r in summary["steps"]],
            "ours_stages_s": stages, "ours_flops": flops,
            "ours_mfu": {s: f / (stages[s] * peak) for s, f in flops.items()},
            "ours_peak_memory_gb": max(mems) if mems else None,
            "ours_tokens": {"prompt_len": prompt_len, "response_len": response}}


# ------------------------------------------------------------------------------------------ TRL
OOM_EXIT = 3  # the TRL side's exit code when training ran out of GPU memory


def run_trl(args, *, workdir: Path) -> dict:
    """TRL's side in its own process; with --trl-grad-ckpt auto, a run out of memory is redone once
    with gradient checkpointing on (the result says so)."""
    out = workdir / "trl.json"

    def once(grad_ckpt: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-side", str(out), "--workdir", str(workdir),
               f"--trl-grad-ckpt={grad_ckpt}",
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("model_yaml", "prompts", "samples", "prompt_len", "response", "trl_steps", "trl_micro",
                          "trl_weights", "lr", "beta", "seed", "device")]]
        return subprocess.run(cmd, cwd=ROOT)

    proc = once(args.trl_grad_ckpt)
    retried = None
    if proc.returncode == OOM_EXIT and args.trl_grad_ckpt == "auto":
        retried = json.loads(out.read_text()).get("error")
        print("TRL ran out of GPU memory without gradient checkpointing; again with it", flush=True)
        proc = once("on")
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    result = json.loads(out.read_text())
    result["config"]["oom_without_grad_ckpt"] = retried
    return result


def word_tokenizer(vocab_size: int):
    """Words "t0".."t{V-1}" are the ids 0..V-1 (whitespace-separated); eos = pad = the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = f"t{vocab_size - 1}"
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, unk_token=eos)


def trl_side(args) -> None:
    """One TRL GRPOTrainer run of `--trl-steps` optimizer steps; writes its JSON to args.trl_side
    (exit OOM_EXIT, the JSON saying so, when training runs out of GPU memory)."""
    import random

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench_generate import hf_model
    from trl_gsm8k import build_fitting_trainer

    _, shape = load_shape(args.model_yaml)
    on_gpu = args.device.startswith("cuda")
    rng = random.Random(args.seed)
    tokenizer = word_tokenizer(shape.vocab_size)
    prompts = [" ".join(f"t{rng.randrange(shape.vocab_size - 1)}" for _ in range(args.prompt_len))
               for _ in range(args.prompts)]
    dtype = torch.bfloat16 if on_gpu and args.trl_weights == "bf16" else torch.float32
    model = hf_model(shape, device=args.device, dtype=dtype).train()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # beta > 0: TRL builds its reference model with from_pretrained(config._name_or_path)
    init_dir = Path(args.workdir) / "trl_init"
    model.save_pretrained(init_dir)
    model.config._name_or_path = str(init_dir)

    def random_reward(completions, **kwargs) -> list[float]:
        return [rng.random() for _ in completions]

    completions = args.prompts * args.samples
    result = {"step_s": [], "logs": [], "machine": machine(), "versions": versions("trl", "datasets")}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            result["step_s"].append(time.perf_counter() - self.t0)

        def on_log(self, a, state, control, logs=None, **k):
            result["logs"].append({"step": state.global_step, **{key: v for key, v in (logs or {}).items()
                                                                  if isinstance(v, (int, float))}})

    def build(grad_ckpt: bool):
        config = GRPOConfig(
            output_dir=str(Path(args.workdir) / "trl_out"), max_steps=args.trl_steps, learning_rate=args.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=args.beta,
            loss_type="dapo", scale_rewards="group", num_generations=args.samples,
            generation_batch_size=completions, per_device_train_batch_size=args.trl_micro,
            gradient_accumulation_steps=completions // args.trl_micro, max_completion_length=args.response,
            generation_kwargs={"min_new_tokens": args.response}, temperature=1.0, top_p=1.0, top_k=0,
            bf16=on_gpu, use_cpu=not on_gpu, gradient_checkpointing=grad_ckpt, use_vllm=False, logging_steps=1,
            save_strategy="no", report_to="none", seed=args.seed, data_seed=args.seed, dataloader_num_workers=0,
            disable_tqdm=True)
        return GRPOTrainer(model=model, reward_funcs=[random_reward], args=config,
                           train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                           processing_class=tokenizer, callbacks=[StepTimer()])

    trainer, probe = build_fitting_trainer(build, args.trl_grad_ckpt, rows=args.trl_micro,
                                           prompt_len=args.prompt_len,
                                           completion_len=args.response, on_gpu=on_gpu)
    t = trainer.args
    result["config"] = {"per_device_train_batch_size": t.per_device_train_batch_size,
                        "gradient_accumulation_steps": t.gradient_accumulation_steps,
                        "generation_batch_size": t.generation_batch_size,
                        "steps_per_generation": t.steps_per_generation,
                        "gradient_checkpointing": bool(t.gradient_checkpointing),
                        "grad_ckpt_mode": args.trl_grad_ckpt, "memory_probe": probe, "bf16": bool(t.bf16),
                        "weights": ("bf16" if dtype == torch.bfloat16 else "fp32 master, bf16 autocast")
                        if on_gpu else "fp32", "loss_type": "dapo", "scale_rewards": "group"}
    try:
        trainer.train()
    except torch.OutOfMemoryError as e:
        result["error"] = str(e).splitlines()[0]
        write_json(args.trl_side, result)
        sys.exit(OOM_EXIT)
    if torch.cuda.is_available():
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    lengths = [(r["completions/min_length"], r["completions/max_length"]) for r in result["logs"]
               if "completions/min_length" in r]
    if not lengths or any(lo != args.response or hi != args.response for lo, hi in lengths):
        raise RuntimeError(f"TRL completions were not all {args.response} tokens: (min, max) per step {lengths}")
    result["completion_lengths"] = lengths
    write_json(args.trl_side, result)


# ------------------------------------------------------------------------------------- results
GSM8K_EXPERIMENT = "experiment=gsm8k_qwen_coder_0_5b"
# TRL's config key (trl_gsm8k.py) -> ours (the experiment's resolved config), equal on one workload
GSM8K_SAME = {"prompts_per_step": "data.prompts_per_step", "samples": "rollout.n",
              "max_new_tokens": "rollout.max_new_tokens", "temperature": "rollout.temperature",
              "lr": "actor_optim.lr", "weight_decay": "actor_optim.weight_decay",
              "beta": "algo.kl_loss_coef"}


def gsm8k_run_entry(ours_metrics: str, trl_json: str, ours_overrides: list[str]) -> dict:
    """The gsm8k workload from two given runs: our trainer's metrics.jsonl (the experiment
    with `ours_overrides`) and trl_gsm8k.py's JSON. ValueError when they are not the same workload
    or either side timed fewer than 3 steps."""
    from gsm8k_report import summarise

    from hybridflow.config import load_config

    rows = [json.loads(line) for line in Path(ours_metrics).read_text().splitlines() if line.strip()]
    ours = summarise(rows, exclude=set())
    trl = json.loads(Path(trl_json).read_text())
    cfg = load_config([GSM8K_EXPERIMENT, *ours_overrides])
    diff = []
    for key, path in GSM8K_SAME.items():
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        if key not in trl["config"] or float(trl["config"][key]) != float(value):
            diff.append(f"TRL {key}={trl['config'].get(key)!r} vs ours {path}={value!r}")
    if diff:
        raise ValueError(f"--gsm8k-ours and --gsm8k-trl are not the same workload: {'; '.join(diff)}")
    firsts = set(trl.get("first_steps", [1]))
    trl_timed = [t for i, t in enumerate(trl["step_s"], start=1) if i not in firsts]
    if ours["ours_steps_timed"] < 3 or len(trl_timed) < 3:
        raise ValueError(f"gsm8k: {ours['ours_steps_timed']} timed steps of ours ({ours_metrics}) and "
                         f"{len(trl_timed)} of TRL ({trl_json}): need >= 3 on each side")
    trl_s = statistics.median(trl_timed)
    return {"ours_step_s": ours["ours_step_s"], "ours_first_step_s": ours["ours_first_step_s"],
            "ours_step_s_all": [r["timing_s/step"] for r in rows if "timing_s/step" in r],
            "ours_stages_s": ours["ours_stages_s"], "ours_peak_memory_gb": ours["ours_peak_memory_gb"],
            "ours_response_length_mean": ours["per_step"].get("response_length/mean", []),
            "trl_step_s": trl_s, "trl_step_s_all": trl["step_s"], "trl_first_steps": sorted(firsts),
            "trl_peak_memory_gb": trl.get("peak_memory_gb"), "ratio": trl_s / ours["ours_step_s"],
            "config": {"ours": {"experiment": GSM8K_EXPERIMENT, "overrides": ours_overrides,
                                "metrics": str(ours_metrics)},
                       "trl": {"command": trl.get("command"), "config": trl["config"],
                               "calls": trl.get("calls")},
                       "machine": trl.get("machine"), "versions": trl.get("versions")},
            "note": "run on one machine in consecutive device calls: ours steps 2.. (step 1 captures "
                    "the CUDA graphs), TRL's steps after the first of each process; no MFU "
                    "(response lengths vary per sequence)"}


def gsm8k_entry() -> dict:
    ours = json.loads(GSM8K.read_text())
    trl = ours["trl"]
    return {"ours_step_s": ours["ours_step_s"], "trl_step_s": trl["step_s_median"], "trl_step_s_all": trl["step_s"],
            "ratio": trl["step_s_median"] / ours["ours_step_s"], "ours_stages_s": ours["ours_stages_s"],
            "ours_peak_memory_gb": ours["ours_peak_memory_gb"], "trl_peak_memory_gb": trl.get("peak_memory_gb"),
            "config": {"source": {"ours": f"{GSM8K.relative_to(ROOT)} (top level: {ours['command']})",
                                  "trl": f"{GSM8K.relative_to(ROOT)} trl"},
                       "trl_median_of": trl.get("step_s_median_of")},
            "note": "copied, not run here; ours_mfu left out: response lengths vary per sequence"}


def print_table(workloads: dict) -> None:
    nan = float("nan")
    print(f"{'workload':10s}{'ours s':>9s}{'trl s':>9s}{'trl/ours':>9s}  ours MFU by stage")
    for name, w in workloads.items():
        mfu = " ".join(f"{s}={v:.1%}" for s, v in w.get("ours_mfu", {}).items())
        print(f"{name:10s}{w.get('ours_step_s', nan):9.3f}{w.get('trl_step_s', nan):9.3f}"
              f"{w.get('ratio', nan):9.2f}  {mfu}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="w1_0_5b,w1_1_5b", help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--sides", default="ours,trl", help="which sides run: ours,trl | ours | trl")
    ap.add_argument("--out", help="results JSON (written atomically after every workload)")
    ap.add_argument("--append", action="store_true", help="keep the workloads already in --out")
    ap.add_argument("--steps", type=int, default=6, help="our steps; the first is left out of the medians")
    ap.add_argument("--trl-steps", type=int, default=7,
                    help="TRL steps; the first is left out of the median (its steps spread by ~20%% within "
                         "one call on an H200)")
    ap.add_argument("--model-yaml", "--model-override", dest="model_yaml", default=None,
                    help="a hybridflow/conf/model/*.yaml replacing every workload's model (the CPU smoke: tiny.yaml)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--ours", choices=("speed", "default"), default="speed",
                    help="our configuration: bench_rl_step.py --speed, or the product's defaults")
    ap.add_argument("--ours-micro", type=int, default=None,
                    help="with --ours speed, our micro-batch in sequences, update and forward passes (default: "
                         "TRL's: the same micro-batch on both sides)")
    ap.add_argument("--ours-options", default="", help="more overrides of our trainer, space-separated")
    ap.add_argument("--trl-micro", type=int, default=None,
                    help="TRL's per_device_train_batch_size in completions (default: min(64, prompts x samples))")
    ap.add_argument("--trl-grad-ckpt", choices=("auto", "on", "off"), default="auto",
                    help="TRL's gradient checkpointing; auto: on only where the update does not fit without it")
    ap.add_argument("--trl-weights", choices=("fp32", "bf16"), default="fp32",
                    help="the dtype TRL's model is held in on a GPU (fp32: master weights, bf16 autocast)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.001, help="TRL's KL coefficient (ours: algo grpo's 0.001)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="MFU denominator (H200 bf16 matmul)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="TRL's device, cpu also makes ours fp32 (ours runs where "
                    "the trainer puts it); default: cuda when there is one")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--gsm8k-ours", default=None, metavar="METRICS_JSONL",
                    help="our GSM8K run's metrics.jsonl: the gsm8k entry from these runs "
                         "(with --gsm8k-trl) instead of a copy of gsm8k_h200.json")
    ap.add_argument("--gsm8k-trl", default=None, metavar="TRL_JSON", help="trl_gsm8k.py's JSON of the same workload")
    ap.add_argument("--gsm8k-ours-overrides", default="",
                    help="the Hydra overrides our GSM8K run used besides the experiment (space-separated)")
    ap.add_argument("--trl-side", default=None, help=argparse.SUPPRESS)  # internal: run TRL, write here
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    names = [w for w in args.workloads.split(",") if w]
    args.sides = [x for x in args.sides.split(",") if x]
    if not args.sides or set(args.sides) - {"ours", "trl"}:
        raise ValueError(f"--sides {','.join(args.sides)}: expected ours,trl | ours | trl")
    if (args.gsm8k_ours is None) != (args.gsm8k_trl is None):
        raise ValueError("--gsm8k-ours and --gsm8k-trl go together")
    if (not names and args.gsm8k_ours is None) or any(w not in WORKLOADS for w in names):
        raise ValueError(f"--workloads {args.workloads!r}: expected names among {', '.join(WORKLOADS)}")
    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: need >= 2 (the first is left out of the medians)")
    if args.trl_steps < 3:
        raise ValueError(f"--trl-steps {args.trl_steps}: need >= 3 (>= 2 timed steps after the first)")
    args.trl_micro = args.trl_micro or min(64, args.prompts * args.samples)
    args.ours_micro = args.ours_micro or args.trl_micro
    if (args.prompts * args.samples) % args.trl_micro:
        raise ValueError(f"--trl-micro {args.trl_micro} must divide prompts x samples = {args.prompts * args.samples}")
    if not 9 <= args.prompt_len <= 160:
        raise ValueError(f"--prompt-len {args.prompt_len}: expected 9..160 (copy task: letters + 8 tokens, "
                         "bench_rl_step's data.max_prompt_length=160)")
    return args, names


def main(argv=None) -> dict:
    args, names = parse_args(argv)
    if args.trl_side:
        trl_side(args)
        return {}
    cmd = command()
    record = {"benchmark": "our GRPO step vs TRL GRPOTrainer step", "command": cmd,
              "peak_tflops": args.peak_tflops, "workloads": {}}
    if args.append and args.out and Path(args.out).is_file():
        # the kept workloads keep the machine, versions, note and commands they were measured with
        prev = json.loads(Path(args.out).read_text())
        record.update({k: prev[k] for k in ("machine", "versions", "note") if k in prev},
                      workloads=prev["workloads"])
        record["earlier_commands"] = prev.get("earlier_commands", []) + [prev["command"]]
    if args.gsm8k_ours is not None:
        record["workloads"]["gsm8k"] = gsm8k_run_entry(args.gsm8k_ours, args.gsm8k_trl,
                                                       args.gsm8k_ours_overrides.split())
        record["workloads"]["gsm8k"]["config"]["assembled_by"] = cmd
    elif "trl_first_steps" not in record["workloads"].get("gsm8k", {}):  # a run entry survives --append
        record["workloads"]["gsm8k"] = gsm8k_entry()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_yaml = args.model_yaml or WORKLOADS[name]
            model, shape = load_shape(model_yaml)
            workdir = Path(args.workdir or tmp) / name
            workdir.mkdir(parents=True, exist_ok=True)
            entry = {"config": {
                "model_yaml": model_yaml, "prompts": args.prompts, "samples": args.samples,
                "prompt_len": args.prompt_len, "response_len": args.response, "forced_length": True,
                "temperature": 1.0, "lr": args.lr, "kl_coef": args.beta, "device": args.device,
                "processes": " then ".join(args.sides) + ", each in its own process"}}
            if "ours" in args.sides:
                ours = run_ours(args, model=model, workdir=workdir)
                entry.update(ours_entry(ours["results"]["grpo"], shape=shape, args=args))
                entry["config"]["ours"] = {"algo": "grpo", "steps": args.steps, "configuration": args.ours,
                                           "micro_batch": args.ours_micro if args.ours == "speed" else None,
                                           "options": ours_options(args),
                                           "overrides": ours["runs"]["grpo"]["overrides"],
                                           "calibration_record": ours["records"][0]["config"]}
                record.update(machine=ours["machine"], versions=ours["versions"])
            if "trl" in args.sides:
                trl = run_trl(argparse.Namespace(**{**vars(args), "model_yaml": model_yaml}), workdir=workdir)
                later = trl["step_s"][1:]
                if len(later) < 2:
                    raise RuntimeError(f"TRL timed {len(trl['step_s'])} steps; --trl-steps must give >= 2 after "
                                       "the first")
                entry.update(trl_step_s=statistics.median(later), trl_step_s_all=trl["step_s"],
                             trl_peak_memory_gb=trl.get("peak_memory_gb"),
                             trl_completion_lengths=trl["completion_lengths"])
                entry["config"]["trl"] = {"steps": args.trl_steps, **trl["config"]}
                record.update(machine=trl["machine"], versions={**record.get("versions", {}), **trl["versions"]})
            if "ours_step_s" in entry and "trl_step_s" in entry:
                entry["ratio"] = entry["trl_step_s"] / entry["ours_step_s"]
            record["workloads"][name] = entry
            if args.out:
                write_json(args.out, record)
    if args.out:
        write_json(args.out, record)
    print_table(record["workloads"])
    return record


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad arguments or inputs: one line, no traceback
        sys.exit(f"bench_vs_trl.py: error: {e}")
