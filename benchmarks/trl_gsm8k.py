"""TRL's GRPOTrainer on the GSM8K workload: seconds per step and greedy val accuracy per step.

The peer baseline beside our GRPO run: same model file, same train/val data, same prompts per step,
samples per prompt, max new tokens, temperature, learning rate and KL coefficient, bf16, no vLLM
(TRL generates with transformers `generate`). Results JSON is rewritten (atomically) after every step,
so a run cut by the time budget, or killed, still leaves its numbers.

  # on the GPU machine (after benchmarks/gsm8k_peers.sh installed trl/datasets into /tmp/site-packages)
  python benchmarks/trl_gsm8k.py --model /tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      --train .gsm8k/train.parquet --val .gsm8k/val.parquet --out $OUT/trl_gsm8k.json --max-steps 20 --time-budget-s 500 --val-at 0,10,20
  # smaller matched run for accuracy per step: --prompts-per-step 16 --samples 8 --micro-batch 64

Accuracy per step, cheaply and like for like: `--save-at 0,5,10` saves the policy at those optimizer
steps (0: before training) as HF directories `--workdir`/snapshots/step_<N> (fp32 safetensors,
config.json, generation_config.json with the stop ids, tokenizer.json / tokenizer_config.json /
chat_template.jinja), each written to a temporary folder and renamed into place, listed in the JSON as
`snapshots` [[step, path], ...]; then `bash benchmarks/gsm8k_h200.sh score DIR...` (one process,
benchmarks/score_snapshots.py) scores them with OUR validation, the one our own run reports, in
seconds each, instead of `--val-at` (transformers generate, ~2 device minutes per point on the H200).
The device-call recipe and its device minutes: the top of benchmarks/gsm8k_peers.sh.

Choices (each one an option; the defaults are ours):
- The model: a GGUF file is loaded by transformers with `GgufConfig(dequantize=True)` (a plain dense
  model); where transformers still marks it quantized (and so refuses to fine-tune it) it is rebuilt
  as a plain model of the same class (`gsm8k_hf_eval.load_model`). `--model` may also be an HF
  directory (our exporter's output). Weights stay fp32 with bf16 autocast (`bf16=True`):
  pure-bf16 Adam would lose 1e-6 updates to rounding, and our trainer keeps fp32 master weights too
  (`--weights bf16`: the model held in bf16, faster, as many TRL users run it).
  With `beta` > 0 TRL loads its reference model from `config._name_or_path`, so the rebuilt model is
  first saved (fp32 safetensors) under `--workdir`/hf_from_gguf and its config pointed there.
- Stop tokens: `generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]` (+ the tokenizer's
  EOS); TRL stops at, and masks after, every id listed there, as our rollout stops at its EOS.
- Batch, TRL's fastest configuration that fits one GPU, as its users tune it: TRL counts
  completions, not prompts. `generation_batch_size` = prompts x samples (`--generation-batch-size`):
  the whole step's completions come from one `generate` call; `per_device_train_batch_size` =
  `--micro-batch` completions (64) and `gradient_accumulation_steps` = prompts x samples /
  micro-batch, so one optimizer step consumes that one generation batch (as one of our steps does).
- Gradient checkpointing (`--grad-ckpt`): `auto` (default) turns it on only where the update does
  not fit without it: one forward + backward of TRL's own log-prob pass over a micro-batch of the
  longest shape (the longest train prompt + `--max-new-tokens`) without it, before training
  (`probe_update_memory`; its peak + AdamW's states must stay within 85% of the GPU, as the probe
  leaves the step's other allocations out). At the GSM8K shape (64 x ~1,209 tokens) the probe
  needs most of an H200, so `auto` turns it on on an H100 and an H200 alike.
  `on` / `off` force it. (TRL's own defaults give the same batch: its `steps_per_generation`
  defaults to `gradient_accumulation_steps`; a smaller `--generation-batch-size` splits generation
  into several `generate` calls per optimizer step.)
- Loss: TRL's `dapo` (token mean over the batch, like our `token-mean`), group-std-normalised
  advantages (`scale_rewards="group"`, our `norm_adv_by_std`), clip 0.2, k3 KL loss with
  `beta`, constant LR without warm-up, grad-norm clip 1.0.
- Reward: hybridflow's `math_exact` (`--reward`: any hybridflow rule, a registry name or
  module:function) on the completion text against `reward_model.ground_truth`.
- Step time: `on_step_begin` -> `on_step_end` with CUDA synchronised (generation, scoring, forward,
  backward and optimizer of one optimizer step); `step_s_median` leaves out the first step.
  Validation runs in `on_step_end` after the timer stops (and before training for step 0), greedy,
  through `benchmarks/gsm8k_hf_eval.evaluate`.
- `--time-budget-s` (from process start): training stops before a step (plus its validation) that the
  last step's time (plus the next validation and snapshot, as the last ones took) says would not fit.
- `--resume` spans device calls (the machine keeps /tmp while warm): a run stopped by the budget saves
  a Trainer checkpoint (weights, optimizer, scheduler, RNG, data position; 30 s of the budget are kept
  for it) under `--workdir` beside a copy of the results JSON; the next run with `--resume` continues
  from it and appends to that JSON. The first step of every process is left out of the median.
  Snapshots of steps up to the checkpoint stay listed; one of a later step (a process killed before
  it checkpointed) is saved again when that step is redone. Without `--resume`, checkpoints and
  snapshots left in `--workdir` are removed first.

  # calls of 10 minutes for 20 steps at a smaller batch, a snapshot every 5 steps
  python benchmarks/trl_gsm8k.py ... --prompts-per-step 16 --max-steps 20 --save-at 0,5,10,15,20 \
      --time-budget-s 540 --resume      # the same command again in the next call
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

START = time.perf_counter()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gsm8k_hf_eval import (default_dtype, evaluate, load_model, load_records, load_tokenizer,  # noqa: E402
                           machine, stop_token_ids, versions, write_json)
from run_record import command  # noqa: E402


def rule_reward(name: str = "math_exact"):
    """A TRL reward function: hybridflow's rule `name` (registry name or module:function) of each
    completion against its ground truth."""
    from hybridflow.reward import get_reward_fn

    rule = get_reward_fn(name)

    def reward(completions, ground_truth, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # chat or plain
        return [float(rule("", t, gt, None)) for t, gt in zip(texts, ground_truth)]

    reward.__name__ = name.rsplit(":", 1)[-1]  # TRL logs rewards/<__name__>/mean
    return reward



def train_dataset(records):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": m["role"], "content": m["content"]} for m in r["prompt"]],
                               "ground_truth": str(r["reward_model"]["ground_truth"])} for r in records])


def parse_steps(text: str, *, option: str = "--val-at") -> list[int]:
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"{option} must be comma-separated step numbers, got {text!r}") from None
    if steps and steps[0] < 0:
        raise ValueError(f"{option}: steps must be >= 0, got {text!r}")
    return steps


def save_snapshot(model, tokenizer, *, root: Path, step: int) -> Path:
    """`model` and `tokenizer` as an HF directory `root`/step_<step>, written to a temporary folder
    and renamed into place: a reader sees a whole snapshot or none. One left by a process killed
    before its next Trainer checkpoint (so that step is trained again) is replaced."""
    final, tmp, old = (root / f"{p}step_{step}{s}" for p, s in (("", ""), (".", ".tmp"), (".", ".old")))
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    model.save_pretrained(tmp)  # weights as held (fp32), config.json, generation_config.json (stop ids)
    tokenizer.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


# options that must match for --resume to continue a run
RESUME_KEYS = ("model", "train", "prompts_per_step", "samples", "micro_batch", "generation_batch_size",
               "max_new_tokens", "temperature", "lr", "weight_decay", "beta", "loss_type", "reward",
               "gradient_checkpointing", "bf16", "weights", "seed")
ADAM_STATE_BYTES = 8  # per trained parameter: AdamW's two fp32 moments, made at the first optimizer step
# of the GPU the probed update may plan for; the rest is what the probe leaves out (the step's
# loss temporaries, generation's outputs, allocator fragmentation). Provenance: at 0.95 an H200
# passed the GSM8K probe and ran out of memory in its second step
# (benchmarks/results/gsm8k_speed_h200/trl_call/trl_gsm8k.json)
MEMORY_SHARE = 0.85
SAVE_RESERVE_S = 30.0  # budget kept for writing the checkpoint (fp32 weights + Adam: ~6 GB at 0.5B)


def median_later_steps(result: dict) -> float | None:
    """Median step time leaving out the first step of every process (warm-up, allocator, graphs)."""
    later = [t for i, t in enumerate(result["step_s"], start=1) if i not in result["first_steps"]]
    return statistics.median(later) if later else None


def resumed_result(result: dict, prior_path: Path, step: int) -> dict:
    """`result` continued from the saved results of the run whose checkpoint is at `step`."""
    if not prior_path.is_file():
        raise ValueError(f"--resume: checkpoint at step {step} but no {prior_path} to continue")
    prior = json.loads(prior_path.read_text())
    differs = {k: (prior["config"].get(k), result["config"][k]) for k in RESUME_KEYS
               if prior["config"].get(k) != result["config"][k]}
    if differs:
        raise ValueError(f"--resume: options differ from the saved run's {differs} (saved, now); "
                         "drop --resume or use another --workdir")
    # rows of steps after the checkpoint (a process killed before it saved again) are redone: drop them
    result.update(step_s=prior["step_s"][:step], first_steps=[s for s in prior["first_steps"] if s <= step],
                  val=[r for r in prior["val"] if r["step"] <= step],
                  logs=[r for r in prior["logs"] if r["step"] <= step],
                  calls=prior.get("calls", 1) + 1, steps_done=step)
    for key in ("val_accuracy", "val_accuracy_strict", "snapshots"):
        if key in prior:
            result[key] = [r for r in prior[key] if r[0] <= step]
    result["step_s_median"] = median_later_steps(result)
    return result


def build_fitting_trainer(build, mode: str, *, rows: int, prompt_len: int, completion_len: int,
                          on_gpu: bool):
    """(trainer, probe): `build(grad_ckpt)` with gradient checkpointing per `mode` (on | off |
    auto: off when probe_update_memory says the update fits); the peak-memory counter reset after
    the probe, so a run's peak is training's."""
    probe = None
    trainer = build(mode == "on")
    if mode == "auto":
        probe = probe_update_memory(trainer, rows=rows, prompt_len=prompt_len,
                                    completion_len=completion_len)
        print("update memory probe (no gradient checkpointing):", probe, flush=True)
        if not probe["fits"]:
            del trainer
            gc.collect()
            trainer = build(True)
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return trainer, probe


def probe_update_memory(trainer, *, rows: int, prompt_len: int, completion_len: int) -> dict:
    """One forward + backward of TRL's own log-prob pass (`_get_per_token_logps_and_entropies`, the
    one its loss runs) over `rows` sequences of `prompt_len` + `completion_len` tokens, on the
    trainer as built (gradient checkpointing off): {"fits", "oom", "peak_gib", ...}. It fits when
    it ran and its peak plus AdamW's states stays within MEMORY_SHARE of the GPU. On CPU it only
    runs (fits: True: no device memory to fit)."""
    model = trainer.model
    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    ids = torch.randint(0, model.config.vocab_size - 1, (rows, prompt_len + completion_len), device=device)
    if on_gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    oom = False
    try:
        logps = trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), completion_len,
                                                           compute_entropy=True)[0]
        logps.float().mean().backward()
        del logps
    except torch.OutOfMemoryError:
        oom = True
    model.zero_grad(set_to_none=True)
    gc.collect()
    info = {"rows": rows, "seq_len": prompt_len + completion_len, "oom": oom}
    if not on_gpu:
        return {**info, "fits": True}
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    adam = ADAM_STATE_BYTES * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {**info, "peak_gib": peak / 2**30, "adam_gib": adam / 2**30, "total_gib": total / 2**30,
            "fits": not oom and peak + adam <= MEMORY_SHARE * total}


def make_callback(*, result: dict, outs: list, val_at: list[int], val_fn, budget_s: float | None,
                  save_on_stop: bool = False, save_at: tuple[int, ...] = (), snapshot_fn=None):
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    reserve = SAVE_RESERVE_S if save_on_stop else 0.0

    def save():
        for out in outs:
            write_json(out, result)

    class StepTimer(TrainerCallback):
        """Times each optimizer step, validates and snapshots at chosen steps, keeps the budget,
        saves the JSON."""

        snapshot_s = 0.0  # the last snapshot's seconds: what the next one is budgeted at

        def _snapshot(self, step: int, model):
            t0 = time.perf_counter()
            path = str(snapshot_fn(step, model))
            self.snapshot_s = time.perf_counter() - t0
            result["snapshots"] = [r for r in result.get("snapshots", []) if r[0] != step] + [[step, path]]

        def _validate(self, step: int, model):
            val = val_fn(model)  # {"accuracy": {rule: acc}, "seconds", ...}
            result["val_accuracy"].append([step, val["accuracy"]["math_exact"]])
            if "gsm8k_strict" in val["accuracy"]:
                result.setdefault("val_accuracy_strict", []).append([step, val["accuracy"]["gsm8k_strict"]])
            result["val"].append({"step": step, **val})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0 and 0 in val_at:
                self._validate(0, model)
            if state.global_step == 0 and 0 in save_at:
                self._snapshot(0, model)
            result["first_steps"].append(state.global_step + 1)
            result["train_start_s"] = time.perf_counter() - START
            save()

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            sync()
            result["step_s"].append(time.perf_counter() - self.t0)
            result["step_s_median"] = median_later_steps(result)
            if torch.cuda.is_available():
                result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
            step = state.global_step
            if step in val_at:
                self._validate(step, model)
            if step in save_at:
                self._snapshot(step, model)
            result["steps_done"] = step
            result["stopped_by_budget"] = False
            if budget_s is not None and step < state.max_steps:
                elapsed = time.perf_counter() - START
                next_val = result["val"][-1]["seconds"] if (step + 1) in val_at and result["val"] else 0.0
                next_val += self.snapshot_s if (step + 1) in save_at else 0.0
                if elapsed + result["step_s"][-1] + next_val + reserve > budget_s:
                    result["stopped_by_budget"] = True
                    control.should_training_stop = True
                    control.should_save = save_on_stop  # Trainer saves right after this callback
            save()
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                result["logs"].append({"step": state.global_step, **{k: v for k, v in logs.items()
                                                                      if isinstance(v, (int, float))}})

    return StepTimer()


def longest_prompt_tokens(tokenizer, records) -> int:
    """Tokens of the longest prompt as TRL feeds it (chat template + generation prompt)."""
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in records]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file or an HF directory")
    ap.add_argument("--train", required=True, help="verl-format train file (.parquet or .jsonl)")
    ap.add_argument("--val", help="verl-format val file; needed with --val-at")
    ap.add_argument("--out", required=True, help="JSON results path (rewritten after every step)")
    ap.add_argument("--prompts-per-step", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (num_generations)")
    ap.add_argument("--micro-batch", type=int, default=64, help="completions per forward/backward")
    ap.add_argument("--generation-batch-size", type=int, default=None,
                    help="completions per generate call (default: prompts x samples, the whole step in one)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.001, help="KL loss coefficient (k3)")
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="AdamW weight decay (TRL's default 0; our GSM8K experiment's 0.01)")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--grad-ckpt", choices=("auto", "on", "off"), default="auto",
                    help="gradient checkpointing; auto: on only where the update does not fit without it")
    ap.add_argument("--weights", choices=("fp32", "bf16"), default="fp32",
                    help="the dtype the model is held in on a GPU (fp32: master weights, bf16 autocast)")
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--time-budget-s", type=float, default=None, help="stop before a step that would end past this")
    ap.add_argument("--val-at", default="", help="steps to validate at, e.g. 0,10,20")
    ap.add_argument("--save-at", default="",
                    help="steps to save the policy at as an HF dir --workdir/snapshots/step_N, e.g. 0,5,10")
    ap.add_argument("--reward", default="math_exact",
                    help="hybridflow reward rule: a registry name or module:function")
    ap.add_argument("--val-size", type=int, default=None, help="first N val records (default all)")
    ap.add_argument("--val-batch-size", type=int, default=64)
    ap.add_argument("--val-max-new-tokens", type=int, default=None, help="default: --max-new-tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workdir", default="/tmp/trl_gsm8k",
                    help="TRL's output_dir: the reference model's HF copy, checkpoints with --resume")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the checkpoint in --workdir if any; save one when the budget stops the run")
    args = ap.parse_args(argv)
    completions = args.prompts_per_step * args.samples
    args.generation_batch_size = args.generation_batch_size or completions
    if completions % args.micro_batch:
        raise ValueError(f"--micro-batch {args.micro_batch} must divide prompts x samples = {completions}")
    gen = args.generation_batch_size
    if completions % gen or gen % args.micro_batch or gen % args.samples:
        raise ValueError(f"--generation-batch-size {gen} must divide prompts x samples = {completions} and be a "
                         f"multiple of --micro-batch {args.micro_batch} and --samples {args.samples}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    completions = args.prompts_per_step * args.samples
    val_at = parse_steps(args.val_at)
    save_at = parse_steps(args.save_at, option="--save-at")
    if val_at and not args.val:
        raise ValueError("--val-at needs --val")
    on_gpu = args.device.startswith("cuda")

    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = get_last_checkpoint(str(workdir)) if args.resume else None
    snapshots = workdir / "snapshots"
    if not args.resume:  # a fresh run: nothing of an earlier one may be mistaken for its own
        for old in [*workdir.glob("checkpoint-*"), snapshots]:
            shutil.rmtree(old, ignore_errors=True)
    tokenizer = load_tokenizer(args.model)
    dtype = torch.bfloat16 if on_gpu and args.weights == "bf16" else torch.float32
    model = load_model(args.model, dtype=dtype, device=args.device, trainable=True)
    if args.model.endswith(".gguf") and args.beta != 0.0:
        # TRL builds its reference model with from_pretrained(config._name_or_path): give it a plain copy
        hf_dir = workdir / "hf_from_gguf"
        if checkpoint is None or not (hf_dir / "config.json").is_file():
            model.save_pretrained(hf_dir)
        model.config._name_or_path = str(hf_dir)
    stops = stop_token_ids(tokenizer)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    train_records = load_records(args.train)
    train = train_dataset(train_records)
    val_records = load_records(args.val, limit=args.val_size) if val_at else []
    val_tokens = args.val_max_new_tokens or args.max_new_tokens
    autocast = default_dtype(args.device) if on_gpu else None

    def build(grad_ckpt: bool):
        grpo = GRPOConfig(
            output_dir=args.workdir, max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=args.weight_decay, max_grad_norm=1.0, beta=args.beta,
            loss_type=args.loss_type, num_generations=args.samples, generation_batch_size=args.generation_batch_size,
            per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=completions // args.micro_batch,
            max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
            bf16=on_gpu, use_cpu=not on_gpu, gradient_checkpointing=grad_ckpt, use_vllm=False, logging_steps=1,
            save_strategy="no", save_total_limit=1, report_to="none", seed=args.seed, data_seed=args.seed,
            dataloader_num_workers=0, disable_tqdm=True)
        return GRPOTrainer(model=model, reward_funcs=[rule_reward(args.reward)], args=grpo, train_dataset=train,
                           processing_class=tokenizer)

    trainer, probe = build_fitting_trainer(
        build, args.grad_ckpt, rows=args.micro_batch,
        prompt_len=longest_prompt_tokens(tokenizer, train_records),
        completion_len=args.max_new_tokens, on_gpu=on_gpu)

    def val_fn(m):
        r = evaluate(m, tokenizer, val_records, batch_size=args.val_batch_size, max_new_tokens=val_tokens,
                     autocast_dtype=autocast)
        return {k: r[k] for k in ("accuracy", "mean_response_length", "clip_ratio", "seconds", "notes")}

    t = trainer.args
    config = dict(model=args.model, train=args.train, val=args.val, prompts_per_step=args.prompts_per_step,
                  samples=args.samples, micro_batch=t.per_device_train_batch_size,
                  grad_accum=t.gradient_accumulation_steps, generation_batch_size=t.generation_batch_size,
                  steps_per_generation=t.steps_per_generation, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, lr=args.lr, weight_decay=args.weight_decay, beta=args.beta,
                  loss_type=args.loss_type, reward=args.reward, save_at=save_at,
                  gradient_checkpointing=bool(t.gradient_checkpointing), grad_ckpt_mode=args.grad_ckpt,
                  memory_probe=probe, bf16=on_gpu, max_steps=args.max_steps,
                  time_budget_s=args.time_budget_s, val_at=val_at, val_size=len(val_records),
                  val_batch_size=args.val_batch_size, val_max_new_tokens=val_tokens, stop_token_ids=stops,
                  seed=args.seed, weights=("bf16" if dtype == torch.bfloat16 else "fp32 master, bf16 autocast")
                  if on_gpu else "fp32", trl_eos_token_ids=list(trainer.eos_token_ids))
    result = {"benchmark": "trl_gsm8k", "config": config, "step_s": [], "step_s_median": None, "first_steps": [],
              "val_accuracy": [], "val": [], "snapshots": [], "logs": [], "steps_done": 0,
              "stopped_by_budget": False, "calls": 1, "resumed_from": checkpoint,
              "load_s": time.perf_counter() - START, "machine": machine(), "versions": versions("trl", "datasets"),
              "command": command()}
    mirror = workdir / "result.json"  # what the next --resume call continues
    if checkpoint is not None:
        resumed_result(result, mirror, int(checkpoint.rsplit("-", 1)[1]))
    outs = [args.out, mirror]
    for out in outs:
        write_json(out, result)

    def snapshot_fn(step, m):
        return save_snapshot(m, tokenizer, root=snapshots, step=step)

    trainer.add_callback(make_callback(result=result, outs=outs, val_at=val_at, val_fn=val_fn,
                                       budget_s=args.time_budget_s, save_on_stop=args.resume, save_at=save_at,
                                       snapshot_fn=snapshot_fn))
    trainer.train(resume_from_checkpoint=checkpoint)
    result["total_s"] = time.perf_counter() - START
    for out in outs:
        write_json(out, result)
    print({k: result[k] for k in ("steps_done", "step_s", "step_s_median", "val_accuracy", "stopped_by_budget")})
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad arguments or inputs: one line, no traceback
        sys.exit(f"trl_gsm8k.py: error: {e}")
