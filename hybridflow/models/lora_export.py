"""LoRA adapters out of a checkpoint: a PEFT adapter directory, or the adapters merged into HF weights.

Our adapter tensors (models/lora.py) have global names
`decoder.layers.{i}.<linear>.lora.{A,B}.<peft name>`, A (r, in) and B (out, r) for each PEFT
target, already unfused (one pair per q/k/v/gate/up target), so PEFT's form is a renaming:
    base_model.model.model.layers.{i}.{self_attn|mlp}.<peft name>.lora_{A,B}.weight
with adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, lora_dropout, bias "none",
task_type CAUSAL_LM, base_model_name_or_path). `peft.PeftModel.from_pretrained(base, dir)` loads
it onto the Hugging Face base model. `merge_into_hf` adds alpha / r * B @ A to the HF weights.
"""

from __future__ import annotations

import errno
import json
import os
import re
from typing import Mapping

import torch

from hybridflow.atomic import staged_dir
from hybridflow.models.lora import PEFT_PARENT, is_adapter_name

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
