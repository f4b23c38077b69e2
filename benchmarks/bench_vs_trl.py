r"""Our GRPO step vs TRL 1.16's GRPOTrainer step on the same synthetic workload, one run (issue "Speed").

Workloads (random-init weights of our model shape, 8 prompts x 8 samples, ~128-token prompts, exactly
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

Each side runs in its own process, one after the other (ours, then TRL), so neither holds GPU memory
while the other runs and each peak-memory number is its own process's:
- ours: benchmarks/bench_rl_step.py --algos grpo --skip-old-log-prob (one mini-batch per step: the
  trainer's default skips the old-log-prob pass, and TRL has none either), TRL's micro-batch
  (`--ours-micro`, default `--trl-micro`'s: all 64 sequences in one pass; at bench_rl_step's 8 the
  passes are bound by kernel launches, ~0.83 ms per layer per micro-batch), bf16, the `copy` task with
  `data.synthetic_length` = prompt length - 8 (its prompts are that many letters + 8 tokens), and
  `--ours-options` (default: the generator and its CUDA graphs kept across steps, the decode over
  the written KV columns in 64-column windows: the GSM8K experiment's options that apply at forced
  lengths; recorded under config.ours.options).
  Step and stage times are medians of the steps after the first.
- TRL: this file with `--trl-side` (a hidden option): the HF Qwen2 of the same shape
  (bench_generate.hf_model) loaded in fp32 and trained under bf16 autocast (`bf16=True`) as
  trl_gsm8k.py does (pure-bf16 Adam would lose 1e-6 updates; ours keeps fp32 master weights too);
  a WordLevel tokenizer whose words "t0".."t{V-1}" are the model's ids (eos = pad = the last id,
  never in a prompt) and 8 prompts of prompt-length random words; num_generations 8,
  per_device_train_batch_size `--trl-micro` completions and gradient accumulation so one optimizer
  step consumes the 64 completions of 8 prompts (trl_gsm8k's convention); `min_new_tokens` =
  `max_completion_length` in generation_kwargs forces every completion to full length (checked from
  TRL's logged completion lengths); loss `dapo`, scale_rewards "group", beta 0.001 (so both sides run
  a reference forward: TRL loads it from the random weights saved to `--workdir`), gradient
  checkpointing on (TRL's default, the setting of the measured GSM8K runs), a random reward per
  completion (non-zero advantages). Step time: on_step_begin -> on_step_end with CUDA synchronised;
  `trl_step_s` is the median of the steps after the first.
MFU of our stages = stage FLOPs / (stage seconds x `--peak-tflops`), FLOPs from hybridflow/cost/flops.py
at the measured tokens: gen = prefill of each distinct prompt once (our generator shares it between
the n samples) + decode at mean context P + R/2; ref and old_log_prob = 1 forward over P + R tokens
per sequence; update_actor = 3 forwards (fwd + bwd; our trainer has no activation recompute);
step = their sum over the step's seconds. On CPU the MFU numbers are meaningless, computed alike.

CPU smoke (tiny model, a few tokens; tests/dist/test_bench_scripts.py):
  python benchmarks/bench_vs_trl.py --workloads w1_0_5b --model-yaml hybridflow/conf/model/tiny.yaml \
      --device cpu --prompt-len 16 --response 8 --prompts 2 --samples 2 --steps 3 --trl-steps 3 --out /tmp/v.json

On the H200, one device call per workload (both in one call would need ~8 of its 10 minutes; the
JSON is rewritten after each workload, so a cut call keeps the finished one). The second call adds
its workload to the first's JSON with `--append` while the machine stays warm (/tmp survives);
after a cold start it writes its own, to be merged by hand.
Here, once (.whl/ and .whl_bench/ are git-ignored, so `carry` can name them):
  bash ../shared/gpu/fetch_wheels.sh .whl                # megatron-core, hydra-core, omegaconf, antlr4
  bash benchmarks/fetch_peer_wheels.sh .whl_bench        # trl 1.16, datasets, dill, multiprocess (+ fallback/)
Each call, carry [".whl", ".whl_bench"]:
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && python3 benchmarks/install_peer_wheels.py .whl_bench --target /tmp/site \
    && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_vs_trl.py --workloads w1_0_5b \
       --out /tmp/vs_trl/vs_trl_h200.json; cp /tmp/vs_trl/vs_trl_h200.json $OUT/
  (second call: the same with `--workloads w1_1_5b --append`)
Device minutes, estimated (TRL not yet measured at this shape): wheels ~0.5; ours ~1.2 min trainer
start + 6 steps of ~1.3 s (0.5B, rl_step_h200.json) / ~3 s (1.5B); TRL ~0.5 min load and weight save
+ 4 steps of ~10-25 s (transformers generate: 256 tokens at batch 64, launch-bound, plus the
checkpointed update) => ~3-4 min per call, ~8 minutes for both.

GSM8K in consecutive calls of one warm machine (the GGUF carried in parts and assembled first:
benchmarks/gsm8k_h200.sh setup; carry [".whl", ".whl_bench", ".gsm8k"]), ours with the trainer
options of the speed runs that apply (the experiment's own generation options are already its):
  1. RUN_DIR=/tmp/gsm8k_vs bash benchmarks/gsm8k_h200.sh train 240 trainer.total_steps=10 \
       trainer.val_every=0 trainer.save_every=0 rollout.decode_kernels=triton rollout.compile_decode=true
     (~3 min: model load, 10 steps of ~7 s), then in the same call
     MODEL=/tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf PHASES=trl TRL_RESUME=1 TRL_STEPS=4 \
       TRL_ARGS="--lr 3e-6 --weight-decay 0.01" TOTAL_S=330 bash benchmarks/gsm8k_peers.sh
  2. the TRL command again (resumes; each call's first step is its warm-up) until its JSON holds 3
     timed steps (TRL: ~85 s load, 150-165 s for a call's first step, 85-95 s after);
  3. python benchmarks/bench_vs_trl.py --workloads "" --append --out benchmarks/results/vs_trl_h200.json \
       --gsm8k-ours $OUT/metrics.jsonl --gsm8k-trl $OUT/trl_gsm8k.json \
       --gsm8k-ours-overrides "trainer.total_steps=10 trainer.val_every=0 rollout.decode_kernels=triton ..."
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
from gsm8k_hf_eval import machine, versions, write_json  # noqa: E402  (write_json: temp file + os.replace)

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
# compaction does nothing at forced lengths; compile_decode is left to --ours-options until the
# trainer-side run has been timed with it
OURS_OPTIONS = "rollout.free_cache_engine=false rollout.decode_kv_window=64"


def run_ours(args, *, model: str, workdir: Path) -> dict:
    out = workdir / "ours.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_rl_step.py"), "--model", model, "--algos", "grpo",
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--response", str(args.response), "--micro", str(args.ours_micro),
           "--fmicro", str(args.ours_micro), "--skip-old-log-prob",
           "--override", f"data.synthetic_length={args.prompt_len - 8}",
           "--override", f"actor_optim.lr={args.lr}", "--out", str(out)]
    for o in args.ours_options.split():
        cmd += ["--override", o]
    if args.device == "cpu":
        cmd += ["--override", "trainer.precision=fp32"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return json.loads(out.read_text())["results"]["grpo"]


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
def run_trl(args, *, workdir: Path) -> dict:
    out = workdir / "trl.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-side", str(out), "--workdir", str(workdir),
           *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("model_yaml", "prompts", "samples", "prompt_len", "response", "trl_steps", "trl_micro",
                      "lr", "beta", "seed", "device")]]
    if args.trl_no_grad_ckpt:
        cmd.append("--trl-no-grad-ckpt")
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def word_tokenizer(vocab_size: int):
    """Words "t0".."t{V-1}" are the ids 0..V-1 (whitespace-separated); eos = pad = the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = f"t{vocab_size - 1}"
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, unk_token=eos)


def trl_side(args) -> None:
    """One TRL GRPOTrainer run of `--trl-steps` optimizer steps; writes its JSON to args.trl_side."""
    import random

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench_generate import hf_model

    _, shape = load_shape(args.model_yaml)
    on_gpu = args.device.startswith("cuda")
    rng = random.Random(args.seed)
    tokenizer = word_tokenizer(shape.vocab_size)
    prompts = [" ".join(f"t{rng.randrange(shape.vocab_size - 1)}" for _ in range(args.prompt_len))
               for _ in range(args.prompts)]
    model = hf_model(shape, device=args.device, dtype=torch.float32).train()
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

    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl_out"), max_steps=args.trl_steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=args.beta,
        loss_type="dapo", scale_rewards="group", num_generations=args.samples,
        per_device_train_batch_size=args.trl_micro, gradient_accumulation_steps=completions // args.trl_micro,
        max_completion_length=args.response, generation_kwargs={"min_new_tokens": args.response},
        temperature=1.0, top_p=1.0, top_k=0, bf16=on_gpu, use_cpu=not on_gpu,
        gradient_checkpointing=not args.trl_no_grad_ckpt, use_vllm=False, logging_steps=1, save_strategy="no",
        report_to="none", seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[random_reward], args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
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
    """The gsm8k workload from runs of this session: our trainer's metrics.jsonl (the experiment
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
    print(f"{'workload':10s}{'ours s':>9s}{'trl s':>9s}{'trl/ours':>9s}  ours MFU by stage")
    for name, w in workloads.items():
        mfu = " ".join(f"{s}={v:.1%}" for s, v in w.get("ours_mfu", {}).items())
        print(f"{name:10s}{w['ours_step_s']:9.3f}{w['trl_step_s']:9.3f}{w['ratio']:9.2f}  {mfu}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="w1_0_5b,w1_1_5b", help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--out", help="results JSON (written atomically after every workload)")
    ap.add_argument("--append", action="store_true", help="keep the workloads already in --out")
    ap.add_argument("--steps", type=int, default=6, help="our steps; the first is left out of the medians")
    ap.add_argument("--trl-steps", type=int, default=7,
                    help="TRL steps; the first is left out of the median (6 timed: its steps spread "
                         "8-11 s within one call at w1_1_5b on an H200)")
    ap.add_argument("--model-yaml", "--model-override", dest="model_yaml", default=None,
                    help="a hybridflow/conf/model/*.yaml replacing every workload's model (the CPU smoke: tiny.yaml)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--ours-micro", type=int, default=None,
                    help="our micro-batch in sequences, update and forward passes (default: TRL's, "
                         "min(64, prompts x samples): the same micro-batch on both sides)")
    ap.add_argument("--trl-micro", type=int, default=None,
                    help="TRL's per_device_train_batch_size in completions (default: min(64, prompts x samples))")
    ap.add_argument("--trl-no-grad-ckpt", action="store_true", help="turn TRL's gradient checkpointing off")
    ap.add_argument("--ours-options", default=OURS_OPTIONS,
                    help="our trainer's overrides for the run, space-separated (default: the "
                         "generation options of the GSM8K experiment that apply to forced lengths: "
                         "the generator and its graphs kept across steps, the decode over the "
                         "written KV columns in 64-column windows); '' for the trainer's defaults")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.001, help="TRL's KL coefficient (ours: algo grpo's 0.001)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="MFU denominator (H200 bf16 matmul)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="TRL's device, cpu also makes ours fp32 (ours runs where "
                    "the trainer puts it); default: cuda when there is one")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--gsm8k-ours", default=None, metavar="METRICS_JSONL",
                    help="our GSM8K run's metrics.jsonl: the gsm8k entry from runs of this session "
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
    command = " ".join(["python", *sys.argv])
    record = {"benchmark": "our GRPO step vs TRL GRPOTrainer step", "command": command,
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
        record["workloads"]["gsm8k"]["config"]["assembled_by"] = command
    elif "trl_first_steps" not in record["workloads"].get("gsm8k", {}):  # a run entry survives --append
        record["workloads"]["gsm8k"] = gsm8k_entry()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_yaml = args.model_yaml or WORKLOADS[name]
            model, shape = load_shape(model_yaml)
            workdir = Path(args.workdir or tmp) / name
            workdir.mkdir(parents=True, exist_ok=True)
            entry = ours_entry(run_ours(args, model=model, workdir=workdir), shape=shape, args=args)
            trl = run_trl(argparse.Namespace(**{**vars(args), "model_yaml": model_yaml}), workdir=workdir)
            later = trl["step_s"][1:]
            if len(later) < 2:
                raise RuntimeError(f"TRL timed {len(trl['step_s'])} steps; --trl-steps must give >= 2 after the first")
            entry.update(trl_step_s=statistics.median(later), trl_step_s_all=trl["step_s"],
                         trl_peak_memory_gb=trl.get("peak_memory_gb"),
                         trl_completion_lengths=trl["completion_lengths"])
            entry["ratio"] = entry["trl_step_s"] / entry["ours_step_s"]
            entry["config"] = {
                "model_yaml": model_yaml, "prompts": args.prompts, "samples": args.samples,
                "prompt_len": args.prompt_len, "response_len": args.response, "forced_length": True,
                "temperature": 1.0, "lr": args.lr, "kl_coef": args.beta, "device": args.device,
                "ours": {"algo": "grpo", "steps": args.steps, "micro_batch": args.ours_micro,
                         "precision": "fp32" if args.device == "cpu" else "bf16",
                         "skip_old_log_prob": True,
                         "activation_recompute": "parallel.activation_checkpointing=true"
                                                 in args.ours_options.split(),
                         "options": args.ours_options.split()},
                "trl": {"steps": args.trl_steps, "per_device_train_batch_size": args.trl_micro,
                        "gradient_accumulation_steps": args.prompts * args.samples // args.trl_micro,
                        "loss_type": "dapo", "scale_rewards": "group",
                        "gradient_checkpointing": not args.trl_no_grad_ckpt,
                        "weights": "fp32 master, bf16 autocast" if args.device != "cpu" else "fp32"},
                "processes": "ours then TRL, each in its own process"}
            record["workloads"][name] = entry
            record.update(machine=trl["machine"], versions=trl["versions"])
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
