"""Transformers' greedy accuracy of a model on a verl-format val file (the GSM8K peer baseline).

The reference number our step-0 validation of the GSM8K run is compared against: the same GGUF file loaded
by transformers (`from_pretrained(dir, gguf_file=...)`, dequantised), the same prompts rendered by the
tokenizer's chat template with the generation prompt, greedy decoding, scored with hybridflow's own
reward rules.

  # on the GPU machine (bf16 weights, batch 64, up to 1,024 new tokens)
  python benchmarks/gsm8k_hf_eval.py --model /tmp/xfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
      --val .gsm8k/val.parquet --out $OUT/gsm8k_hf_eval.json --generations $OUT/gsm8k_hf_generations.jsonl
  # batch 320 = the whole val set in one generate call (fastest; a batch runs to its longest answer)
  # an HF directory (our exporter's output) works the same: --model /path/to/hf_dir

Choices:
- Stop tokens: `<|im_end|>`, `<|endoftext|>` and the tokenizer's EOS (a GGUF tokenizer reports one
  or the other as EOS depending on the transformers version), all handed to `generate` as
  `eos_token_id`, so generation stops at the end of the assistant turn whichever it reports.
- Left padding with a real pad token (the tokenizer's, else `<|endoftext|>`, else EOS); prompts are
  sorted by length before batching (less padding) and results put back in file order.
- A response is cut after its first stop token; its length counts the generated tokens up to and
  including that stop token (all of them when none came); the text scored is the decode of those
  tokens without special tokens.
- Rewards are looked up by registry name (`hybridflow.reward.get_reward_fn`): `math_exact` and
  `gsm8k_strict` by default; a name that is not registered is skipped with a note in the JSON.
- `evaluate(model, tokenizer, records, ...)` is the library entry; `benchmarks/trl_gsm8k.py` calls it
  on the model TRL is training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_record  # noqa: E402
from run_record import machine, write_json  # noqa: E402,F401  (imported from here by other scripts)

DEFAULT_REWARDS = ("math_exact", "gsm8k_strict")
END_OF_TURN = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"


# ---- data ------------------------------------------------------------------------------------

def load_records(path: str | os.PathLike, *, limit: int | None = None) -> list[dict[str, Any]]:
    """verl-format records ({prompt: [messages], reward_model: {ground_truth}, data_source, ...})."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"val file {str(p)!r} does not exist")
    if p.suffix == ".jsonl":
        with p.open(encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(p).to_pylist()
    else:
        raise ValueError(f"val file {str(p)!r}: expected .jsonl or .parquet")
    for i, r in enumerate(records):
        prompt = r.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)):
            raise ValueError(f"{p}: record {i}: 'prompt' must be a list of chat messages, got {prompt!r:.80}")
        if (r.get("reward_model") or {}).get("ground_truth") is None:
            raise ValueError(f"{p}: record {i}: 'reward_model.ground_truth' is missing")
    return records[:limit] if limit else records


# ---- model and tokenizer ---------------------------------------------------------------------

def _split_model_path(path: str) -> tuple[str, dict]:
    """A `.gguf` file -> (its folder, {"gguf_file": name}); an HF directory -> (it, {})."""
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"model file {path!r} does not exist")
        return str(p.parent), {"gguf_file": p.name}
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model {path!r}: expected a .gguf file or an HF directory with config.json")
    return str(p), {}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    folder, kw = _split_model_path(path)
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    tok.padding_side = "left"
    if tok.pad_token is None:
        pad = END_OF_TEXT if END_OF_TEXT in tok.get_vocab() else tok.eos_token
        tok.pad_token = pad
    return tok


def load_model(path: str, *, dtype: torch.dtype, device: str | torch.device, trainable: bool = False):
    """The model at `path` (.gguf or HF dir). `trainable` rebuilds a GGUF-loaded model as a plain one.

    transformers marks a GGUF-loaded model as quantized (`hf_quantizer`, `is_quantized`) although its
    weights are dequantised tensors, and its Trainer refuses to train it; a fresh model of the same
    class built from the config without `quantization_config`, with the same state dict, is identical
    and trainable.
    """
    from transformers import AutoModelForCausalLM

    folder, kw = _split_model_path(path)
    if "gguf_file" in kw:
        kw.update(_dequantize_config())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    if trainable and getattr(model, "is_quantized", False):
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(model)(config).to(dtype)
        plain.load_state_dict(model.state_dict(), strict=True)  # tied weights appear under both names
        plain.generation_config = model.generation_config
        del model
        model = plain
    return model.to(device).eval()


def _dequantize_config() -> dict:
    """`quantization_config=GgufConfig(dequantize=True)` where transformers has it (5.x).

    Without it transformers 5.17+ first tries to fetch a packed-GGUF matmul kernel from the Hub and
    keeps the weights in their quantized blocks when it gets one; dense dequantised weights are what
    our loader computes with, and what a trainer needs.
    """
    import inspect

    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    if "dequantize" not in inspect.signature(GgufConfig).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def stop_token_ids(tokenizer) -> list[int]:
    """`<|im_end|>`, `<|endoftext|>` (those the vocabulary has) and the tokenizer's EOS, no duplicates.

    Which of the two a GGUF tokenizer reports as EOS differs between transformers versions (5.17:
    `<|endoftext|>`, 5.23: `<|im_end|>`); listing both keeps the stop set the same on either.
    """
    ids = []
    vocab = tokenizer.get_vocab()
    for tid in (vocab.get(END_OF_TURN), vocab.get(END_OF_TEXT), tokenizer.eos_token_id):
        if tid is not None and tid not in ids:
            ids.append(tid)
    if not ids:
        raise ValueError("tokenizer has neither <|im_end|> nor an EOS token: nothing would stop generation")
    return ids


# ---- evaluation ------------------------------------------------------------------------------

def resolve_rewards(names) -> tuple[dict, list[str]]:
    """({name: fn} for the registered names, [notes for the skipped ones])."""
    from hybridflow.reward import get_reward_fn

    fns, notes = {}, []
    for name in names:
        try:
            fns[name] = get_reward_fn(name)
        except (ValueError, FileNotFoundError) as e:
            notes.append(f"reward {name!r} skipped: {e}")
    if not fns:
        raise ValueError(f"none of the rewards {list(names)} could be resolved: {notes}")
    return fns, notes


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: list[str], *, batch_size: int, max_new_tokens: int,
                    autocast_dtype: torch.dtype | None = None) -> tuple[list[str], list[int]]:
    """Greedy responses (text without special tokens, token count incl. the stop token) in input order."""
    stops = stop_token_ids(tokenizer)
    device = next(model.parameters()).device
    encoded = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    texts, lengths = [None] * len(prompts), [0] * len(prompts)
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else torch.autocast(device.type, enabled=False))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in rows]}, padding=True, return_tensors="pt")
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast:
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
        responses = out[:, batch["input_ids"].shape[1]:].tolist()  # (B, <= max_new_tokens)
        for i, resp in zip(rows, responses):
            end = next((j + 1 for j, t in enumerate(resp) if t in stops), len(resp))
            texts[i] = tokenizer.decode(resp[:end], skip_special_tokens=True)
            lengths[i] = end
    return texts, lengths


def evaluate(model, tokenizer, records: list[dict], *, batch_size: int = 64, max_new_tokens: int = 1024,
             rewards=DEFAULT_REWARDS, autocast_dtype: torch.dtype | None = None) -> dict:
    """Greedy accuracy of `model` on `records` under each reward rule.

    Returns {"n", "accuracy": {rule: mean}, "mean_response_length", "clip_ratio", "seconds", "notes",
    "generations": [{"index", "response", "ground_truth", "length", "scores": {rule: score}}]}.
    The model is put in eval mode for the call (gradient checkpointing off, KV cache on) and its
    training flag restored after.
    """
    fns, notes = resolve_rewards(rewards)
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
               for r in records]
    was_training = model.training
    model.eval()
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    try:
        texts, lengths = generate_greedy(model, tokenizer, prompts, batch_size=batch_size,
                                         max_new_tokens=max_new_tokens, autocast_dtype=autocast_dtype)
    finally:
        model.train(was_training)
    sync()
    seconds = time.perf_counter() - t0
    generations = []
    for i, (r, prompt, text, n) in enumerate(zip(records, prompts, texts, lengths)):
        gt = r["reward_model"]["ground_truth"]
        info = {**(r.get("extra_info") or {}), "data_source": r.get("data_source")}
        scores = {name: float(fn(prompt, text, gt, info)) for name, fn in fns.items()}
        generations.append({"index": i, "response": text, "ground_truth": gt, "length": n, "scores": scores})
    count = max(len(records), 1)
    return {"n": len(records),
            "accuracy": {name: sum(g["scores"][name] for g in generations) / count for name in fns},
            "mean_response_length": sum(lengths) / count,
            "clip_ratio": sum(n >= max_new_tokens for n in lengths) / count,
            "seconds": seconds, "notes": notes, "generations": generations}


# ---- run records -----------------------------------------------------------------------------

def versions(*extra: str) -> dict:
    return run_record.versions("transformers", "accelerate", "gguf", *extra)


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file or an HF directory")
    ap.add_argument("--val", required=True, help="verl-format val file (.parquet or .jsonl)")
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--generations", help="also write every generation to this .jsonl")
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (64 on GPU, 8 on CPU)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=None, help="only the first N records")
    ap.add_argument("--rewards", default=",".join(DEFAULT_REWARDS), help="comma-separated registry names")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    batch_size = args.batch_size or (64 if args.device.startswith("cuda") else 8)

    t0 = time.perf_counter()
    records = load_records(args.val, limit=args.limit)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=default_dtype(args.device), device=args.device)
    load_s = time.perf_counter() - t0
    result = evaluate(model, tokenizer, records, batch_size=batch_size, max_new_tokens=args.max_new_tokens,
                      rewards=[r for r in args.rewards.split(",") if r])
    generations = result.pop("generations")
    if args.generations:
        Path(args.generations).parent.mkdir(parents=True, exist_ok=True)
        with open(args.generations, "w", encoding="utf-8") as f:
            for g in generations:
                f.write(json.dumps(g) + "\n")
    out = {"benchmark": "gsm8k_hf_eval", "model": args.model, "val": args.val, **result,
           "load_s": load_s, "batch_size": batch_size, "max_new_tokens": args.max_new_tokens,
           "dtype": str(default_dtype(args.device)).replace("torch.", ""), "stop_token_ids": stop_token_ids(tokenizer),
           "machine": machine(), "versions": versions(), "command": " ".join([sys.executable, *sys.argv])}
    write_json(args.out, out)
    print(json.dumps({k: out[k] for k in ("n", "accuracy", "mean_response_length", "clip_ratio", "seconds")}))
    return out


if __name__ == "__main__":
    main()
