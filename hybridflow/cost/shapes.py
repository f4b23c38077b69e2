"""The cost model's model: a `ModelConfig` (hybridflow.model_config, which also holds the parameter
counts) from a conf/model name, a model YAML, a Hugging Face config.json, or a dict.

Names are looked up in the package `hybridflow.conf` (conf/model/*.yaml), so the installed package
knows the same models as a checkout; config.json goes through the trainer's own reader
(`models/hf_config.py`), so the cost model accepts and describes exactly the models the trainer
builds. Shapes are checked by `config.validate_model`, the trainer's check.
"""
from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

from hybridflow.config import CONF_PACKAGE
from hybridflow.config_checks import validate_model
from hybridflow.model_config import ModelConfig
from hybridflow.models.hf_config import hf_to_model_config, read_hf_config

# fields a model YAML or dict must set: the schema's defaults are the tiny model's
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "vocab_size")


def _model_dir():
    return resources.files(CONF_PACKAGE) / "model"


def known_models() -> list[str]:
    return sorted(p.name[:-len(".yaml")] for p in _model_dir().iterdir() if p.name.endswith(".yaml"))


def _from_mapping(d: dict, name: str) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    missing = [k for k in SHAPE_FIELDS if k not in d]
    if unknown or missing:
        raise ValueError(f"model {name!r}: " + "; ".join(
            ([f"unknown fields {unknown}"] if unknown else [])
            + ([f"lacks {missing}"] if missing else [])) + " (fields of ModelConfig expected)")
    return ModelConfig(**{"name": name, **d})


def _load_yaml(text: str) -> dict:
    import yaml

    return yaml.safe_load(text) or {}


def _resolve(model: str | dict | ModelConfig | Path) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        name = str(model.get("name", model.get("model_type", "custom")))
        if "num_hidden_layers" in model:  # config.json contents
            return hf_to_model_config(model, source=f"HF config {name!r}", name=name)
        return _from_mapping(model, name)
    text = str(model)
    named = _model_dir() / f"{text}.yaml"
    if named.is_file():
        return _from_mapping(_load_yaml(named.read_text()), text)
    path = Path(text)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return _from_mapping(_load_yaml(path.read_text()), path.stem)
    if path.is_dir() or path.is_file():
        return read_hf_config(text)
    raise ValueError(f"unknown model {text!r}: not a name in {CONF_PACKAGE} model/ "
                     f"({', '.join(known_models())}) nor a path to a config.json or model YAML")


def load_shape(model: str | dict | ModelConfig | Path) -> ModelConfig:
    """A conf/model name, a path to a model YAML or HF config.json (or a dir holding config.json),
    a dict of ModelConfig fields (or config.json fields), or a ModelConfig; checked as the trainer
    checks it (any TP/PP: those are checked per layout)."""
    cfg = _resolve(model)
    validate_model(cfg, tp=1, pp=1)
    return cfg
