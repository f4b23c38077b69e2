"""Write a Hugging Face checkpoint directory from full (gathered) weights.

`save_hf_checkpoint(out_dir, full_sd, cfg)` writes what `transformers.AutoModelForCausalLM
.from_pretrained(out_dir)` and our own `load_hf_weights` read: safetensors shards of at most
`max_shard_bytes` plus `model.safetensors.index.json` (or one `model.safetensors`), `config.json`
(architecture kept from `cfg.hf_architecture`), `generation_config.json` and the tokenizer files of
`tokenizer_dir`. `full_sd` may use Megatron global names (converted with
`megatron_to_hf_state_dict`) or already be HF-named. Tensors keep their dtype.
The directory is written into a temporary folder beside `out_dir` and renamed into place
(`hybridflow.atomic.staged_dir`), so a crash never leaves a half-written checkpoint under `out_dir`
and a failed write (a full disk) leaves no temporary behind. An existing `out_dir` is replaced
when it is empty or a model folder (has a config.json); any other folder or file is refused, not
deleted. Weights are serialized in memory and written by Python, so a full disk is an OSError with
its errno (safetensors' own writer reports it as text).

LoRA adapters (models/lora.py: global names `decoder.layers.{i}.<linear>.lora.{A,B}.<peft name>`,
A (r, in) and B (out, r), already one pair per q/k/v/gate/up target) leave as a PEFT adapter
directory, a renaming: `base_model.model.model.layers.{i}.{self_attn|mlp}.<name>.lora_{A,B}.weight`
in adapter_model.safetensors plus adapter_config.json (peft_type LORA, r, lora_alpha,
target_modules, lora_dropout, bias "none", task_type CAUSAL_LM, base_model_name_or_path), which
`peft.PeftModel.from_pretrained(base, dir)` loads; or `merge_into_hf` adds alpha / r * B @ A to the
HF weights (fp32 math).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from typing import Mapping, Optional

import torch

from hybridflow.atomic import staged_dir
from hybridflow.config import ModelConfig
from hybridflow.models.hf_config import load_json, write_hf_config
from hybridflow.models.hf_names import megatron_to_hf_state_dict
from hybridflow.models.lora import PEFT_PARENT, is_adapter_name

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
    hf_sd = dict(full_sd) if _is_hf_named(full_sd) else megatron_to_hf_state_dict(full_sd, cfg)
    if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} does not exist")
    check_replaceable(out_dir)
    with staged_dir(out_dir, replace=True) as tmp:
        _write(tmp, hf_sd, cfg, tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes)


def check_replaceable(out_dir: str) -> None:
    """`out_dir` may be replaced: absent, an empty folder or a model folder (has a config.json)."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a folder", out_dir)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and \
            not os.path.isfile(os.path.join(out_dir, "config.json")):
        raise FileExistsError(errno.EEXIST, "exists and holds files but no config.json; expected a "
                              "new, empty or model folder", out_dir)


def _write(tmp: str, hf_sd: dict, cfg: ModelConfig, *, tokenizer_dir: Optional[str],
           max_shard_bytes: int) -> None:
    from safetensors.torch import save

    shards = _shards(hf_sd, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        # clone: q/k/v and gate/up are views of one packed tensor; safetensors refuses shared storage
        tensors = {n: hf_sd[n].detach().to("cpu").contiguous().clone() for n in names}
        with open(os.path.join(tmp, fname), "wb") as f:
            f.write(save(tensors, metadata={"format": "pt"}))
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


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


_NAME = re.compile(r"^decoder\.layers\.(\d+)\..*\.lora\.([AB])\.(\w+)$")


def split_adapters(full_sd: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(base tensors, adapter tensors) of a full state dict."""
    base = {k: v for k, v in full_sd.items() if not is_adapter_name(k)}
    return base, {k: v for k, v in full_sd.items() if is_adapter_name(k)}


def peft_state_dict(adapter_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in adapter_sd.items():
        m = _NAME.match(name)
        if m is None:
            raise ValueError(f"not a LoRA adapter tensor name: {name!r}")
        layer, factor, target = m.groups()
        out[f"base_model.model.model.layers.{layer}.{PEFT_PARENT[target]}.{target}."
            f"lora_{factor}.weight"] = t
    return out


def adapter_config(lora: dict, *, base_model: str, targets: list) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": int(lora["rank"]), "lora_alpha": lora["alpha"],
            "lora_dropout": lora["dropout"], "target_modules": sorted(targets), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "revision": None}


def save_peft_adapter(out_dir: str, adapter_sd: Mapping[str, torch.Tensor], *, lora: dict,
                      base_model: str) -> None:
    """Write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""
    from safetensors.torch import save

    if os.path.isdir(out_dir) and os.listdir(out_dir) and \
            not os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
        raise FileExistsError(errno.EEXIST, "exists and holds files but no adapter_config.json; "
                              "expected a new, empty or adapter folder", out_dir)
    sd = peft_state_dict(adapter_sd)
    targets = sorted({k.split(".")[-3] for k in sd})
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}
    with staged_dir(out_dir, replace=True) as tmp:
        with open(os.path.join(tmp, "adapter_model.safetensors"), "wb") as f:
            f.write(save(tensors, metadata={"format": "pt"}))
        with open(os.path.join(tmp, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(adapter_config(lora, base_model=base_model, targets=targets), f, indent=2,
                      sort_keys=True)
            f.write("\n")


def merge_into_hf(hf_sd: dict, adapter_sd: Mapping[str, torch.Tensor], *, lora: dict) -> dict:
    """HF tensors with scale * B @ A added to each adapted weight (computed in fp32)."""
    scale = lora["alpha"] / lora["rank"]
    peft = peft_state_dict(adapter_sd)
    out = dict(hf_sd)
    for key, a in peft.items():
        if ".lora_A." not in key:
            continue
        b = peft[key.replace(".lora_A.", ".lora_B.")]
        name = key.replace("base_model.model.", "", 1).replace(".lora_A.weight", ".weight")
        w = out[name]
        out[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out
