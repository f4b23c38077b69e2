"""A LoRA checkpoint scored two ways on the same GSM8K val problems: by our own validation, and as
the exported PEFT adapter on the Hugging Face base under transformers + peft.

The end-to-end check of `python -m hybridflow.export` on the real model and task: the adapter
directory it writes (not merged) is loaded with `peft.PeftModel.from_pretrained` onto the base that
transformers reads from the same GGUF file (dequantised), and generates greedily on the first
`--limit` val problems with the prompt text of the chat template, the same max new tokens and stop
tokens (`<|im_end|>`, `<|endoftext|>`), scored with the same reward rules
(benchmarks/gsm8k_hf_eval.py). Our side is the run's validation of the same checkpoint
(`python -m hybridflow.train ... trainer.val_only=true trainer.resume=true`: prompts, template,
greedy, stop tokens, rules as in training). The base model (no adapter) is scored by our validation
too, so the adapter's effect is visible: its accuracy and how many generations the adapter changed.

  # make the checkpoint (GRPO on the GSM8K recipe, LoRA rank 32 alpha 32, a few CPU-sized steps),
  # then score it; fp32 on CPU
  python benchmarks/peft_export_eval.py --train-steps 2 --work /tmp/peft_eval \\
      --model /work/cache/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --data /work/main/.gsm8k \\
      --limit 64 --max-new-tokens 512 --out benchmarks/results/peft_export_cpu.json \\
      --card benchmarks/results/small_cards_h200.json
  # an existing LoRA run: its output_dir (newest step) or one step_<N> directory
  python benchmarks/peft_export_eval.py --checkpoint outputs/run/checkpoints/step_25 ...

Choices:
- The LoRA settings (rank, alpha, dropout, targets) of our validation come from the checkpoint's
  `lora_config_actor.json`; a chosen step is scored through a checkpoint root of its own under
  `--work` that links to it (nothing is written into the run's folder).
- The val problems are the first `--limit` of `<data>/val.parquet`, written to `--work` as a val
  file of their own, so both sides see the same records in the same order.
- Accuracy is the training rule (`math_exact`); `gsm8k_strict` is reported beside it. Agreement is
  problem by problem (`hybridflow.validation.paired_comparison`: discordant counts, McNemar's exact
  p); generations count as identical when their texts are equal with the trailing stop token removed.
- Each stage's result is kept in `--work` with its settings (training.json, ours_adapter.json,
  ours_base.json, transformers_peft.json); a rerun with the same settings reuses the stages that
  finished.
- transformers marks a GGUF-loaded model as quantized; the base is rebuilt as a plain model first
  (gsm8k_hf_eval.load_model(trainable=True)) so peft wraps ordinary Linear layers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from run_record import command, machine, versions, write_json  # noqa: E402

RULES = ("math_exact", "gsm8k_strict")  # the recipe's reward.fn and reward.val_fns
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")
STAGES = ("ours_adapter", "ours_base", "transformers_peft")


# ---- our side: hybridflow.train subprocesses ---------------------------------------------------

def recipe_overrides(model: str, train_file: str, val_file: str, *, max_new_tokens: int,
                     limit: int) -> list[str]:
    """The GSM8K recipe on CPU (fp32), validation as the run's: greedy, `max_new_tokens`."""
    return ["experiment=gsm8k_qwen_coder_0_5b", f"model.gguf_path={model}",
            f"data.train_files={train_file}", f"data.val_files={val_file}",
            "trainer.precision=fp32", f"trainer.val_max_new_tokens={max_new_tokens}",
            f"trainer.val_log_generations={limit}", "trainer.tensorboard=false",
            "trainer.progress_bar=false"]


def train_overrides(*, steps: int, lr: float, rank: int, alpha: float, prompts: int, samples: int,
                    max_new_tokens: int, output_dir: str) -> list[str]:
    """A few GRPO steps with LoRA at a CPU-sized batch (token budgets that fit in host memory)."""
    rows = prompts * samples
    return [f"actor.lora.rank={rank}", f"actor.lora.alpha={alpha}", f"actor_optim.lr={lr}",
            f"data.prompts_per_step={prompts}", f"rollout.n={samples}",
            f"rollout.max_new_tokens={max_new_tokens}", f"algo.ppo_mini_batch_size={rows}",
            "algo.micro_batch_size_per_gpu=2", "algo.forward_micro_batch_size_per_gpu=4",
            "algo.max_tokens_per_micro_batch_per_gpu=2048",
            "algo.forward_max_tokens_per_micro_batch_per_gpu=4096",
            f"trainer.total_steps={steps}", "trainer.save_every=0", "trainer.val_every=0",
            "trainer.val_before_train=false", f"trainer.output_dir={output_dir}",
            "trainer.resume=false"]


def lora_overrides(step_dir: str) -> list[str]:
    """actor.lora.* as the checkpoint recorded them (lora_config_actor.json)."""
    path = os.path.join(step_dir, "lora_config_actor.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{step_dir}: no lora_config_actor.json; expected a checkpoint of a "
                                "run with actor.lora.rank > 0")
    with open(path, encoding="utf-8") as f:
        lora = json.load(f)
    targets = ",".join(lora["target_modules"])
    return [f"actor.lora.rank={lora['rank']}", f"actor.lora.alpha={lora['alpha']}",
            f"actor.lora.dropout={lora['dropout']}", f"actor.lora.target_modules=[{targets}]"]


def sampler_overrides(step_dir: str) -> list[str]:
    """The batch keys resuming the checkpoint checks (its prompt sampler's state), with a
    training batch shape that fits them; validation (greedy, one answer per prompt) uses none."""
    path = os.path.join(step_dir, "trainer_state.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        sampler = json.load(f).get("sampler", {})
    out = []
    if "batch_size" in sampler:
        b = sampler["batch_size"]
        out += [f"data.prompts_per_step={b}", "rollout.n=2", f"algo.ppo_mini_batch_size={2 * b}",
                "algo.micro_batch_size_per_gpu=1", "algo.forward_micro_batch_size_per_gpu=1"]
    if "seed" in sampler:
        out.append(f"trainer.seed={sampler['seed']}")
    if "shuffle" in sampler:
        out.append(f"data.shuffle={str(bool(sampler['shuffle'])).lower()}")
    return out


def run_train(overrides: list[str], log: Path) -> float:
    """`python -m hybridflow.train <overrides>` in one process; its output to `log`. -> seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.run([sys.executable, "-m", "hybridflow.train", *overrides], cwd=ROOT,
                              env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"hybridflow.train failed (exit {proc.returncode}); see {log}:\n"
                           + log.read_text()[-3000:])
    return time.perf_counter() - t0


def link_step(step_dir: str, root: Path) -> None:
    """`root`/step_<N> -> `step_dir` and `root`/latest: a checkpoint root holding that one step."""
    root.mkdir(parents=True, exist_ok=True)
    name = os.path.basename(os.path.normpath(step_dir))
    link = root / name
    if not link.exists():
        link.symlink_to(os.path.realpath(step_dir), target_is_directory=True)
    (root / "latest").write_text(name.split("_", 1)[1] + "\n")


def read_validation(output_dir: Path) -> dict:
    """One val_only run's per-problem scores and generations (index order)."""
    (scores,) = [json.loads(x) for x in open(output_dir / "val_scores.jsonl") if x.strip()]
    gens = sorted((json.loads(x) for x in open(output_dir / "val_generations.jsonl") if x.strip()),
                  key=lambda g: g["index"])
    (metrics,) = [json.loads(x) for x in open(output_dir / "metrics.jsonl") if x.strip()]
    if scores["index"] != [g["index"] for g in gens]:
        raise ValueError(f"{output_dir}: val_generations.jsonl does not cover every scored problem "
                         "(trainer.val_log_generations too small?)")
    return {"index": scores["index"],
            "scores": {"math_exact": scores["scores"]["reward"],
                       "gsm8k_strict": scores["scores"]["gsm8k_strict"]},
            "responses": [g["response"] for g in gens], "prompts": [g["prompt"] for g in gens],
            "metrics": metrics}


def cached(path: Path, key: dict, compute) -> dict:
    """`compute()`, kept in `path` with `key`; a later call with the same key reads it back (a
    rerun after a failure does not repeat the stages that finished)."""
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            print(f"reusing {path}", flush=True)
            return saved["value"]
    value = compute()
    write_json(path, {"key": key, "value": value})
    return value


def ours_validation(overrides: list[str], output_dir: Path, *, step_dir: str | None) -> dict:
    """Our validation (trainer.val_only) of the base model (`step_dir` None) or of a checkpoint."""
    return cached(output_dir.with_suffix(".json"), {"overrides": overrides, "step_dir": step_dir},
                  lambda: _ours_validation(overrides, output_dir, step_dir=step_dir))


def _ours_validation(overrides: list[str], output_dir: Path, *, step_dir: str | None) -> dict:
    if output_dir.exists():
        shutil.rmtree(output_dir)  # an unfinished earlier attempt
    fixed = ["trainer.val_only=true", f"trainer.output_dir={output_dir}"]
    if step_dir is None:
        fixed.append("trainer.resume=false")
    else:
        link_step(step_dir, output_dir / "checkpoints")
        fixed += ["trainer.resume=true", "trainer.resume_allow_data_change=true",
                  *lora_overrides(step_dir), *sampler_overrides(step_dir)]
    seconds = run_train([*overrides, *fixed], output_dir.with_suffix(".log"))
    return {**read_validation(output_dir), "seconds": seconds}


# ---- transformers + peft -------------------------------------------------------------------------

def peft_validation(model: str, adapter_dir: str, records: list[dict], *, max_new_tokens: int,
                    batch_size: int) -> dict:
    """transformers' greedy generation of the HF base (from `model`) with the PEFT adapter, fp32."""
    import peft
    import torch

    from gsm8k_hf_eval import evaluate, load_model, load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(model)
    base = load_model(model, dtype=torch.float32, device="cpu", trainable=True)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    load_s = time.perf_counter() - t0
    out = evaluate(adapted, tok, records, batch_size=batch_size, max_new_tokens=max_new_tokens,
                   rewards=RULES)
    gens = out["generations"]
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
               for r in records]
    return {"scores": {rule: [g["scores"][rule] for g in gens] for rule in RULES},
            "responses": [g["response"] for g in gens], "prompts": prompts,
            "mean_response_length": out["mean_response_length"], "clip_ratio": out["clip_ratio"],
            "seconds": out["seconds"], "load_s": load_s, "notes": out["notes"]}


# ---- comparison --------------------------------------------------------------------------------

def strip_stop(text: str) -> str:
    text = text.rstrip()
    for stop in STOP_TEXTS:
        if text.endswith(stop):
            return text[:-len(stop)].rstrip()
    return text


def identical(a: list[str], b: list[str]) -> int:
    return sum(strip_stop(x) == strip_stop(y) for x, y in zip(a, b, strict=True))


def compare(a: dict, b: dict) -> dict:
    """Per rule: accuracies and paired agreement of two validations of the same problems; the
    count of identical generations."""
    from hybridflow.validation import paired_comparison

    out = {}
    for rule in RULES:
        x, y = a["scores"][rule], b["scores"][rule]
        paired = paired_comparison(x, y)
        both = sum(u > 0.5 and v > 0.5 for u, v in zip(x, y))
        neither = sum(u <= 0.5 and v <= 0.5 for u, v in zip(x, y))
        out[rule] = {**paired, "both_right": both, "both_wrong": neither,
                     "agree": both + neither}
    out["identical_generations"] = identical(a["responses"], b["responses"])
    return out


def accuracy(v: dict) -> dict:
    return {rule: sum(s > 0.5 for s in v["scores"][rule]) / len(v["scores"][rule]) for rule in RULES}


# ---- driver ------------------------------------------------------------------------------------

def resolve_checkpoint(path: str) -> str:
    """A run's output_dir (its checkpoints/ root), a checkpoint root or a step dir -> the step dir."""
    from hybridflow.export import resolve_step_dir

    root = os.path.join(path, "checkpoints")
    return resolve_step_dir(root if os.path.isdir(root) else path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a LoRA run's output_dir, checkpoint root or step_<N> dir")
    src.add_argument("--train-steps", type=int, help="make the checkpoint: N GRPO steps with LoRA")
    ap.add_argument("--model", required=True, help="the base model's .gguf file (the run's model.gguf_path)")
    ap.add_argument("--data", required=True, help="folder with train.parquet and val.parquet")
    ap.add_argument("--work", required=True, help="folder for the run, the adapter and the logs")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--card", help="also set the key peft_export of this results JSON")
    ap.add_argument("--limit", type=int, default=64, help="the first N val problems")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per transformers generate call")
    ap.add_argument("--lr", type=float, default=5e-4, help="--train-steps: actor_optim.lr")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--prompts", type=int, default=4, help="--train-steps: prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="--train-steps: samples per prompt")
    ap.add_argument("--train-max-new-tokens", type=int, default=256)
    ap.add_argument("--only", choices=STAGES,
                    help="run this one stage (kept in --work) and stop: stages in parallel processes; "
                         "a last call without it reuses them and writes --out")
    args = ap.parse_args(argv)
    if args.limit <= 0 or args.max_new_tokens <= 0:
        raise ValueError(f"--limit and --max-new-tokens must be positive (got {args.limit}, "
                         f"{args.max_new_tokens})")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gsm8k_hf_eval import load_records
    from hybridflow.export import export

    t0 = time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    train_file = os.path.join(args.data, "train.parquet")
    records = load_records(os.path.join(args.data, "val.parquet"), limit=args.limit)
    val_file = work / f"val_first{len(records)}.parquet"
    pq.write_table(pa.Table.from_pylist(records), val_file)
    base_overrides = recipe_overrides(args.model, train_file, str(val_file),
                                      max_new_tokens=args.max_new_tokens, limit=len(records))
    result = {"benchmark": "peft_export_eval", "model": args.model, "data": args.data,
              "settings": {"limit": len(records), "max_new_tokens": args.max_new_tokens,
                           "dtype": "float32", "device": "cpu", "rules": list(RULES),
                           "transformers_batch_size": args.batch_size},
              "machine": machine(),
              "versions": versions("transformers", "peft", "gguf", "megatron-core"),
              "command": command()}
    if args.train_steps is not None:
        run_dir = work / "run"
        train = train_overrides(steps=args.train_steps, lr=args.lr, rank=args.rank, alpha=args.alpha,
                                prompts=args.prompts, samples=args.samples,
                                max_new_tokens=args.train_max_new_tokens, output_dir=str(run_dir))

        def make():
            if run_dir.exists():
                shutil.rmtree(run_dir)  # an unfinished earlier attempt
            train_s = run_train([*base_overrides, *train], work / "train.log")
            metrics = [json.loads(x) for x in open(run_dir / "metrics.jsonl") if x.strip()]
            return {"overrides": train, "seconds": train_s,
                    "reward_per_step": [m.get("critic/score/mean") for m in metrics],
                    "grad_norm_per_step": [m.get("actor/grad_norm") for m in metrics]}

        result["training"] = cached(work / "training.json", {"overrides": [*base_overrides, *train]},
                                    make)
        step_dir = resolve_checkpoint(str(run_dir))
    else:
        step_dir = resolve_checkpoint(args.checkpoint)
    result["checkpoint"] = step_dir
    print(f"checkpoint {step_dir}", flush=True)

    adapter = work / "adapter"
    if args.only in (None, "transformers_peft"):
        export(step_dir, str(adapter))  # the PEFT adapter directory, not merged
    if args.only == "ours_adapter":
        ours_validation(base_overrides, work / "ours_adapter", step_dir=step_dir)
        return {}
    if args.only == "ours_base":
        ours_validation(base_overrides, work / "ours_base", step_dir=None)
        return {}
    with open(adapter / "adapter_config.json", encoding="utf-8") as f:
        conf = json.load(f)
    result["adapter"] = {"dir": str(adapter), "r": conf["r"], "lora_alpha": conf["lora_alpha"],
                         "target_modules": conf["target_modules"]}

    def peft_stage() -> dict:
        return cached(work / "transformers_peft.json",
                      {"model": args.model, "checkpoint": step_dir, "val": str(val_file),
                       "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size},
                      lambda: peft_validation(args.model, str(adapter), records,
                                              max_new_tokens=args.max_new_tokens,
                                              batch_size=args.batch_size))

    if args.only == "transformers_peft":
        peft_stage()
        return {}

    ours = ours_validation(base_overrides, work / "ours_adapter", step_dir=step_dir)
    print(f"ours: {accuracy(ours)} ({ours['seconds']:.0f} s)", flush=True)
    base = ours_validation(base_overrides, work / "ours_base", step_dir=None)
    print(f"base: {accuracy(base)} ({base['seconds']:.0f} s)", flush=True)
    hf = peft_stage()
    print(f"transformers+peft: {accuracy(hf)} ({hf['seconds']:.0f} s)", flush=True)

    n = len(records)
    vs = compare(ours, hf)
    result.update({
        "n": n,
        "ours_val": accuracy(ours)["math_exact"],
        "transformers_peft_val": accuracy(hf)["math_exact"],
        "base_val": accuracy(base)["math_exact"],
        "strict": {"ours_val": accuracy(ours)["gsm8k_strict"],
                   "transformers_peft_val": accuracy(hf)["gsm8k_strict"],
                   "base_val": accuracy(base)["gsm8k_strict"]},
        "ours_vs_transformers_peft": vs,
        "identical_generations": vs["identical_generations"],
        "same_prompt_text": sum(a == b for a, b in zip(ours["prompts"], hf["prompts"], strict=True)),
        "adapter_vs_base": {**compare(ours, base),
                            "generations_changed": n - identical(ours["responses"], base["responses"])},
        "seconds": {"ours_adapter_val": ours["seconds"], "ours_base_val": base["seconds"],
                    "transformers_peft_generate": hf["seconds"], "transformers_load": hf["load_s"],
                    "total": time.perf_counter() - t0},
        "response_length": {"ours_mean": ours["metrics"].get("val-aux/response_length/mean"),
                            "ours_clip_ratio": ours["metrics"].get("val-aux/response_length/clip_ratio"),
                            "transformers_peft_mean": hf["mean_response_length"],
                            "transformers_peft_clip_ratio": hf["clip_ratio"]},
        "generations": [{"index": i, "ours": o, "transformers_peft": t, "base": b,
                         "scores": {"ours": ours["scores"]["math_exact"][i],
                                    "transformers_peft": hf["scores"]["math_exact"][i],
                                    "base": base["scores"]["math_exact"][i]}}
                        for i, (o, t, b) in enumerate(zip(ours["responses"], hf["responses"],
                                                          base["responses"]))],
    })
    write_json(args.out, result)
    if args.card:
        update_card(args.card, result, args.out)
    print(json.dumps({k: result[k] for k in ("n", "ours_val", "transformers_peft_val", "base_val",
                                             "identical_generations")}), flush=True)
    return result


def update_card(path: str, result: dict, out: str) -> None:
    """Set `peft_export` of the JSON at `path` (its other keys as they are); atomic."""
    with open(path, encoding="utf-8") as f:
        card = json.load(f)
    vs = result["ours_vs_transformers_peft"]["math_exact"]
    card["peft_export"] = {
        "ours_val": result["ours_val"], "transformers_peft_val": result["transformers_peft_val"],
        "base_val": result["base_val"], "n": result["n"], "device": "cpu",
        "only_ours": vs["only_a"], "only_transformers_peft": vs["only_b"],
        "mcnemar_p": vs["mcnemar_p"], "identical_generations": result["identical_generations"],
        "file": os.path.basename(out)}
    write_json(path, card)


if __name__ == "__main__":
    main()
