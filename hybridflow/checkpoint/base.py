"""The identity of a LoRA run's frozen base model, which adapter-only checkpoints do not hold.

A checkpoint of a role trained with adapters (actor.lora) stores the adapters, their optimizer
state and the LR schedule, not the base weights; `lora_config_<role>.json` records where the base
came from and a fingerprint of it, under "base":
    {"source": "hf" | "gguf" | "random", "hf_path", "gguf_path", "seed", "fingerprint", "method"}
Fingerprints are cheap (no full read of a 15 GB model):
  hf      sha256 of config.json, model.safetensors.index.json (when there is one) and the name and
          size of every *.safetensors file of the directory;
  gguf    sha256 of the file's first 16 MiB (header, metadata, tokenizer, tensor index) and its size;
  random  sha256 of the initialised weights of decoder layer 0's linear_qkv and linear_proj
          (gathered over TP, so a layout whose init draws the same weights matches), with the seed
          (trainer.seed) that drew them. Megatron's CPU init draws the full matrices and splits
          them (any TP matches); its GPU init draws per TP rank (another TP is another base).
Resume rebuilds the base from the run's config as at start-up, compares fingerprints
(`check_base`) and only then loads the adapters.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Optional

import torch
import torch.distributed as dist

GGUF_HEAD_BYTES = 16 << 20
_METHODS = {
    "hf": "sha256(config.json, model.safetensors.index.json, *.safetensors names and sizes)",
    "gguf": "sha256(first 16 MiB, file size)",
    "random": "sha256(layer 0 linear_qkv and linear_proj weights, TP-gathered)",
}


def hf_fingerprint(hf_dir: str) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        h.update(f"{os.path.basename(path)}:{os.path.getsize(path)}\0".encode())
    return h.hexdigest()


def gguf_fingerprint(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(GGUF_HEAD_BYTES))
    h.update(f"size:{os.path.getsize(path)}".encode())
    return h.hexdigest()


def _layer0_linears(model):
    from megatron.core.utils import unwrap_model

    bare = unwrap_model(model)
    for layer in getattr(getattr(bare, "decoder", None), "layers", []):
        if layer.layer_number == 1:
            return [layer.self_attention.linear_qkv, layer.self_attention.linear_proj]
    return []


def random_fingerprint(model) -> str:
    """Collective over the default group: the digest of layer 0's qkv and proj weights as global
    rank 0 (which holds layer 0) sees them, gathered over its TP group."""
    h = hashlib.sha256()
    for linear in _layer0_linears(model):
        param, group = linear.weight, linear.tp_group
        w = param.detach()  # (a detached tensor has none of the TP attributes)
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            parts = [torch.empty_like(w) for _ in range(group.size())]
            dist.all_gather(parts, w.contiguous(), group=group)
            w = torch.cat(parts, dim=param.partition_dim)
        h.update(f"{tuple(w.shape)}:{w.dtype}".encode())
        h.update(w.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digest = [h.hexdigest()]
    dist.broadcast_object_list(digest, src=0)
    return digest[0]


def base_identity(model_cfg, model, *, seed: int) -> dict:
    """This run's base of a LoRA role (collective for a random-init base: every rank calls it)."""
    if model_cfg.hf_path is not None:
        source, fp = "hf", hf_fingerprint(model_cfg.hf_path)
    elif model_cfg.gguf_path is not None:
        from hybridflow.models.gguf_file import resolve_gguf_path

        source, fp = "gguf", gguf_fingerprint(resolve_gguf_path(model_cfg.gguf_path))
    else:
        source, fp = "random", random_fingerprint(model)
    return {"source": source, "hf_path": model_cfg.hf_path, "gguf_path": model_cfg.gguf_path,
            "seed": seed if source == "random" else None, "fingerprint": fp,
            "method": _METHODS[source]}


def describe(identity: dict) -> str:
    src = identity.get("source")
    where = {"hf": f"model.hf_path={identity.get('hf_path')}",
             "gguf": f"model.gguf_path={identity.get('gguf_path')}",
             "random": f"random init, trainer.seed={identity.get('seed')}"}.get(src, repr(src))
    return f"{where} (fingerprint {str(identity.get('fingerprint'))[:16]})"


def check_base(saved: dict, current: dict, *, checkpoint: str, role: str,
               allow_change: bool = False) -> Optional[str]:
    """None when `current` is the base the adapters of `checkpoint` trained on; a warning line
    when it is not and `allow_change`; else ValueError naming the key and both identities."""
    if saved.get("fingerprint") == current.get("fingerprint"):
        return None
    key = {"hf": "model.hf_path", "gguf": "model.gguf_path"}.get(
        current.get("source"), "trainer.seed / model")
    change = (f"{key}: the {role} base model differs from the one the adapters of {checkpoint} "
              f"trained on: saved {describe(saved)}, this run {describe(current)}")
    if allow_change:
        return f"hybridflow: warning: {change}; trainer.resume_allow_base_change=true: resuming"
    raise ValueError(f"{change}; resume with the same base, or set "
                     "trainer.resume_allow_base_change=true to put the adapters on this one")


def read_lora_config(step_path: str, role: str) -> Optional[dict]:
    path = os.path.join(step_path, f"lora_config_{role}.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def adapter_only(step_path: str, role: str) -> bool:
    """Whether `role` of the checkpoint `step_path` holds only its adapters (no base weights)."""
    lora = read_lora_config(step_path, role)
    return bool(lora and lora.get("adapter_only"))
