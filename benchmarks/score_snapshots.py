"""Greedy val accuracy of HF snapshots of a policy (`trl_gsm8k.py --save-at`) by OUR validation.

TRL's own validation (transformers `generate`) costs ~2 device minutes per point on the 319 GSM8K
val prompts; ours takes seconds, and the model load (~60-75 s on the H200) dominates. So one process
builds the trainer once, as `python -m hybridflow.train ... trainer.val_only=true` does (the first
snapshot is `model.hf_path`), then for each snapshot loads its weights into the actor in place
(`components.load_pretrained`, the loader a run uses) and runs the run's validation: the same
prompts, chat template, greedy decoding, stop tokens, max new tokens and reward rules as our own
training run's validation. The numbers are comparable with our run's `val_accuracy` because step 0
of both is the same model scored the same way (tests/peers/test_trl_snapshots.py checks that the
step-0 snapshot gives exactly the generations of the original GGUF file).

  python benchmarks/score_snapshots.py /tmp/trl_gsm8k/snapshots/step_* --out $OUT/trl_scores.json \
      --run-dir /tmp/trl_score -- experiment=gsm8k_qwen_coder_0_5b data.train_files=... data.val_files=...
  (benchmarks/gsm8k_h200.sh score DIR... adds the experiment and data overrides)

Choices:
- Steps come from the directory names (`step_<N>`); snapshots are scored in the order given,
  results are sorted by step. All must have the same shape and byte-identical tokenizer files
  (one tokenizer serves the whole process); anything else is refused.
- Stop tokens: `rollout.stop_token_ids` is set to the ids of `<|im_end|>` and `<|endoftext|>` in
  the snapshot's tokenizer (those it has), besides its EOS: which of the two a saved tokenizer calls
  EOS depends on the transformers version that saved it (5.17 reads the GGUF's as `<|endoftext|>`),
  and our run on the GGUF file stops at both. An override given after `--` wins.
- Output: `--out` JSON, rewritten after every snapshot: `scores` [[step, accuracy, strict], ...]
  (accuracy: `val-core/<source>/reward/mean@1`, the training rule `reward.fn`; strict:
  `val-aux/<source>/gsm8k_strict/mean@1` or null), `val_accuracy` / `val_accuracy_strict` as
  [[step, accuracy], ...] (the shape of `trl.val_accuracy` in benchmarks/results/gsm8k_h200.json),
  every val metric per step, and seconds. `--run-dir` gets metrics.jsonl and val_generations.jsonl
  (rows tagged with the snapshot's step; appended to what is there).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
FIXED_KEYS = ("model.hf_path", "model.gguf_path", "trainer.val_only", "trainer.resume", "trainer.output_dir")


def snapshot_step(path: str) -> int:
    m = re.fullmatch(r"step_(\d+)", Path(path).name)
    if m is None:
        raise ValueError(f"snapshot {path!r}: expected a directory named step_<N> (trl_gsm8k.py --save-at)")
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"snapshot {path!r} has no config.json")
    return int(m.group(1))


def stop_token_ids(hf_dir: str) -> list[int]:
    """Ids of `<|im_end|>` and `<|endoftext|>` in `hf_dir`/tokenizer.json (those it has)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    return [i for i in (tok.token_to_id(t) for t in STOP_TOKENS) if i is not None]


def tokenizer_files(hf_dir: str) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    return {n: (Path(hf_dir) / n).read_bytes() for n in names if (Path(hf_dir) / n).is_file()}


def accuracies(metrics: dict) -> tuple[float, float | None]:
    """(training-rule accuracy, strict accuracy or None) of one validation's metrics."""
    core = [k for k in metrics if k.startswith("val-core/") and k.endswith("/reward/mean@1")]
    if len(core) != 1:
        raise ValueError(f"expected one val-core/<data_source>/reward/mean@1 metric, got {core}: "
                         "one accuracy per snapshot needs one data source in data.val_files")
    strict = core[0].replace("val-core/", "val-aux/", 1).replace("/reward/", "/gsm8k_strict/")
    return metrics[core[0]], metrics.get(strict)


def build_config(first: str, run_dir: str, overrides: list[str]):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.train import resolve_model_source

    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    clash = sorted(given & set(FIXED_KEYS))
    if clash:
        raise ValueError(f"overrides {clash} are set by the scorer (snapshots are positional, --run-dir "
                         "is the output dir)")
    fixed = [f"model.hf_path={first}", "model.gguf_path=null", "trainer.val_only=true",
             "trainer.resume=false", f"trainer.output_dir={run_dir}"]
    if "rollout.stop_token_ids" not in given:
        fixed.append(f"rollout.stop_token_ids=[{','.join(map(str, stop_token_ids(first)))}]")
    cfg = resolve_model_source(load_config([*overrides, *fixed]))
    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return cfg, fixed


def check_like_first(path: str, *, first: str, model_cfg) -> None:
    """`path` can be loaded into the process built for `first` (its `model_cfg`): same model shape,
    byte-identical tokenizer files."""
    from hybridflow.models.hf import read_hf_config

    m = read_hf_config(path)
    ignore = ("name", "hf_path", "attention_backend")
    if {k: v for k, v in vars(m).items() if k not in ignore} != \
            {k: v for k, v in vars(model_cfg).items() if k not in ignore}:
        raise ValueError(f"snapshot {path}: model shape differs from {first}'s; score it in another call")
    if tokenizer_files(path) != tokenizer_files(first):
        raise ValueError(f"snapshot {path}: tokenizer files differ from {first}'s; score it in another call")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshots", nargs="+", help="HF directories named step_<N>")
    ap.add_argument("--out", required=True, help="results JSON (rewritten after every snapshot)")
    ap.add_argument("--run-dir", required=True, help="trainer.output_dir: metrics.jsonl, val_generations.jsonl")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    t0 = time.perf_counter()
    snaps = [(snapshot_step(s), os.path.abspath(s)) for s in args.snapshots]
    if len({s for s, _ in snaps}) != len(snaps):
        raise ValueError(f"two snapshots of one step: {args.snapshots}")
    first = snaps[0][1]
    cfg, fixed = build_config(first, args.run_dir, overrides)
    rank = int(os.environ.get("RANK", "0"))

    from gsm8k_hf_eval import machine, versions, write_json
    from hybridflow.components import load_pretrained
    from hybridflow.parallel import groups
    from hybridflow.run_state import check_output_dir

    check_output_dir(cfg.trainer.output_dir, rank=rank)
    groups.init_distributed(timeout_minutes=cfg.trainer.collective_timeout_s / 60)
    result = {"benchmark": "score_snapshots", "snapshots": [], "scores": [], "val_accuracy": [],
              "val_accuracy_strict": [], "val": [], "reward_fn": cfg.reward.fn,
              "stop_token_ids": list(cfg.rollout.stop_token_ids), "overrides": [*overrides, *fixed],
              "machine": machine(), "versions": versions(), "command": " ".join([sys.executable, *sys.argv])}
    try:
        ctx = groups.init_model_parallel(tp=cfg.parallel.tensor_parallel_size,
                                         pp=cfg.parallel.pipeline_parallel_size,
                                         tp_gen=cfg.rollout.tensor_parallel_size, seed=cfg.trainer.seed,
                                         timeout_minutes=cfg.trainer.collective_timeout_s / 60)
        from hybridflow.trainer import Trainer

        trainer = Trainer(cfg, ctx)  # loads the first snapshot, as trainer.val_only does
        result["build_s"] = time.perf_counter() - t0
        for step, path in snaps:
            t1 = time.perf_counter()
            if path != first:
                check_like_first(path, first=first, model_cfg=cfg.model)
                load_pretrained(trainer.actor, dataclasses.replace(cfg.model, hf_path=path))
            load_s = time.perf_counter() - t1
            trainer.step = step  # tags the logged metrics and generations
            metrics = trainer.validate()
            trainer.logger.log(step, metrics)
            acc, strict = accuracies(metrics)
            result["snapshots"].append([step, path])
            result["scores"].append([step, acc, strict])
            result["val"].append({"step": step, "load_s": load_s, **metrics})
            for key in ("snapshots", "scores", "val"):
                result[key].sort(key=lambda r: r[0] if isinstance(r, list) else r["step"])
            result["val_accuracy"] = [[s, a] for s, a, _ in result["scores"]]
            result["val_accuracy_strict"] = [[s, x] for s, _, x in result["scores"] if x is not None]
            result["total_s"] = time.perf_counter() - t0
            if rank == 0:
                write_json(args.out, result)
                print(f"step {step}: accuracy {acc:.4f} strict {strict} (load {load_s:.1f} s, "
                      f"val {metrics.get('timing_s/val', float('nan')):.1f} s)", flush=True)
        trainer.logger.close()
    finally:
        groups.destroy()
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"score_snapshots: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
