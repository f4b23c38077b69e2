"""Write a Hugging Face checkpoint directory from full (gathered) weights.

`save_hf_checkpoint(out_dir, full_sd, cfg)` writes what `transformers.AutoModelForCausalLM
.from_pretrained(out_dir)` and our own `load_hf_weights` read: safetensors shards of at most
`max_shard_bytes` plus `model.safetensors.index.json` (or one `model.safetensors`), `config.json`
(architecture kept from `cfg.hf_architecture`), `generation_config.json` and the tokenizer files of
`tokenizer_dir`. `full_sd` may use Megatron global names (converted with
`megatron_to_hf_state_dict`) or already be HF-named. Tensors keep their dtype.
The directory is written as `<out_dir>.tmp` and renamed into place, so a crash never leaves a
half-written checkpoint under `out_dir`; an existing `out_dir` is replaced.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Mapping, Optional

import torch

from hybridflow.config import ModelConfig
from hybridflow.models.hf_config import load_json, write_hf_config
from hybridflow.models.hf_names import megatron_to_hf_state_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> None:
    """Copy the tokenizer's files (not the model weights beside them) from src_dir to dst_dir."""
    os.makedirs(dst_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        if name in TOKENIZER_FILES or name.endswith(".model"):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def _is_hf_named(sd: Mapping[str, torch.Tensor]) -> bool:
    return any(k.startswith(("model.", "lm_head.")) for k in sd)


def _shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    return shards + [cur] if cur else shards


def _generation_config(tokenizer_dir: Optional[str]) -> dict:
    """The source's generation_config.json, else BOS/EOS ids looked up from its tokenizer files."""
    if tokenizer_dir is None:
        return {}
    src = os.path.join(tokenizer_dir, "generation_config.json")
    if os.path.isfile(src):
        return load_json(src)
    tok_cfg, tok = (os.path.join(tokenizer_dir, f) for f in ("tokenizer_config.json",
                                                             "tokenizer.json"))
    if not (os.path.isfile(tok_cfg) and os.path.isfile(tok)):
        return {}
    from tokenizers import Tokenizer

    backend, special, out = Tokenizer.from_file(tok), load_json(tok_cfg), {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = special.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and backend.token_to_id(value) is not None:
            out[f"{key}_id"] = backend.token_to_id(value)
    return out


def save_hf_checkpoint(out_dir: str, full_sd: Mapping[str, torch.Tensor], cfg: ModelConfig, *,
                       tokenizer_dir: Optional[str] = None, max_shard_bytes: int = 2**30) -> None:
    """Write `full_sd` (Megatron global names or HF names) as an HF checkpoint at `out_dir`."""
    from safetensors.torch import save_file

    hf_sd = dict(full_sd) if _is_hf_named(full_sd) else megatron_to_hf_state_dict(full_sd, cfg)
    if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} does not exist")
    out_dir = os.path.abspath(out_dir)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards = _shards(hf_sd, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        # clone: q/k/v and gate/up are views of one packed tensor; safetensors refuses shared storage
        tensors = {n: hf_sd[n].detach().to("cpu").contiguous().clone() for n in names}
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    if len(shards) > 1:
        _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    dtype = _DTYPES.get(next(iter(hf_sd.values())).dtype, "float32")
    _write_json(os.path.join(tmp, "config.json"), write_hf_config(cfg, dtype=dtype))
    _write_json(os.path.join(tmp, "generation_config.json"), _generation_config(tokenizer_dir))
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, tmp)
    old = out_dir + ".old"
    if os.path.exists(out_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
