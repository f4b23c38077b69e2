"""Model shapes for the cost model: from conf/model/*.yaml, a Hugging Face config.json, or a dict.

The architecture is the Llama/Qwen2/Mistral decoder that hybridflow builds with megatron-core:
grouped-query attention (QKV with optional bias, output projection without), a SwiGLU MLP (gate, up:
hidden x ffn each, down: ffn x hidden), two RMSNorms per layer plus a final one, a vocab embedding and
an output layer (shared with the embedding when `tie_word_embeddings`). Megatron's vocab padding
(to a multiple of 128 x TP) is ignored: it changes counts by < 0.1% for the models in conf/.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

CONF_MODEL_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    kv_channels: int | None = None     # head dim; None: hidden_size / num_attention_heads
    add_qkv_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "vocab_size"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model {self.name!r}: num_attention_heads must be a multiple of "
                             "num_query_groups")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:      # width of Q and of the attention output
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:     # width of K (and of V)
        return self.num_query_groups * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * f

    @property
    def layer_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) if self.add_qkv_bias else 0
        return self.layer_matmul_params + bias + 2 * self.hidden_size   # + two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_nonembedding_params(self) -> int:   # layers + final norm
        return self.num_layers * self.layer_params + self.hidden_size

    @property
    def num_params(self) -> int:
        out = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_nonembedding_params + self.embedding_params + out

    @property
    def num_critic_params(self) -> int:
        """Same trunk, the output layer replaced by a scalar value head (hidden x 1)."""
        return self.num_nonembedding_params + self.embedding_params + self.hidden_size

    @property
    def num_dense_params(self) -> int:
        """N of the "6N" rule: weights in matmuls per token = layer matmuls + the LM head (V x h).

        Biases, norms and the embedding lookup (a gather, not a matmul) are left out."""
        return self.num_layers * self.layer_matmul_params + self.embedding_params


def _from_mapping(d: dict, name: str) -> ModelShape:
    known = {f.name for f in fields(ModelShape)}
    kw = {k: v for k, v in d.items() if k in known}
    kw.setdefault("name", name)
    try:
        return ModelShape(**kw)
    except TypeError as e:
        raise ValueError(f"model {name!r}: {e}") from None


def _from_hf(cfg: dict, name: str) -> ModelShape:
    try:
        heads = cfg["num_attention_heads"]
        return ModelShape(
            name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
            kv_channels=cfg.get("head_dim"),
            add_qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"HF config {name!r} lacks field {e.args[0]!r}") from None


def known_models() -> list[str]:
    return sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml"))


def _load_yaml(path: Path) -> dict:
    import yaml
    with open(path) as f:
        return yaml.safe_load(f) or {}


def load_shape(model: str | dict | ModelShape | Path) -> ModelShape:
    """A conf/model name, a path to a model YAML or HF config.json (or a dir holding config.json),
    a dict of ModelShape fields (or HF fields), or a ModelShape."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        name = str(model.get("name", model.get("model_type", "custom")))
        return _from_hf(model, name) if "num_hidden_layers" in model else _from_mapping(model, name)
    text = str(model)
    if (CONF_MODEL_DIR / f"{text}.yaml").is_file():
        return _from_mapping(_load_yaml(CONF_MODEL_DIR / f"{text}.yaml"), text)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        if path.suffix in (".yaml", ".yml"):
            return _from_mapping(_load_yaml(path), path.stem)
        with open(path) as f:
            cfg = json.load(f)
        return _from_hf(cfg, path.parent.name or cfg.get("model_type", "hf"))
    raise ValueError(f"unknown model {text!r}: not a name in {CONF_MODEL_DIR} "
                     f"({', '.join(known_models())}) nor a path to a config.json or model YAML")
