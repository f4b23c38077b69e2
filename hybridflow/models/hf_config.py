"""Hugging Face `config.json` <-> `ModelConfig`, for Llama, Qwen2, Qwen3, Qwen3-MoE and Mistral causal LMs.

`read_hf_config(path)` accepts what our one GPTModel architecture (RoPE, RMSNorm, SwiGLU, GQA,
optional QKV bias, optional per-head q/k RMSNorm, tied or untied embeddings) computes exactly, and
refuses the rest with a `ValueError` naming config.json and the field; `hf_to_model_config(dict)`
is the same for config.json contents in memory. The only config.json reader: training, export and
the cost model (`hybridflow.cost.shapes`) all use it. Choices:
- RoPE: plain, or llama3 scaling. Megatron's llama3 scaling takes only `factor`; its low/high
  frequency factors (1, 4) and original context (8192) are fixed, so a config.json with other values
  is refused rather than silently computed differently. Both transformers v4 (`rope_theta` +
  `rope_scaling`) and v5 (`rope_parameters`) spellings are read.
- What differs per `model_type` is one `Arch` row of `ARCHS` (the architecture class, fixed Q/K/V
  biases, q/k norms, how the sliding window is switched on, which flag would bias `o_proj`, the
  fields written back on export); a new dense model type is a new row.
- Sliding windows (Mistral `sliding_window`, Qwen2/Qwen3 `use_sliding_window`): accepted only when
  unset or at least `max_position_embeddings`, where the window never takes effect; our attention
  has no sliding-window mask, so a smaller window would change the outputs.
- Llama's and Qwen3's `attention_bias=true` also biases `o_proj`, which our model (no linear biases)
  cannot hold: refused. Qwen2 always has Q/K/V biases and no `o_proj` bias: `add_qkv_bias=True`.
  Qwen3 always has q/k norms (`q_norm`, `k_norm`: RMSNorm over head_dim, the model's epsilon):
  `qk_layernorm=True`; its head_dim is its own field, independent of hidden / heads.
- `*ForSequenceClassification` checkpoints (reward models) read like their causal LM.
`write_hf_config(cfg)` goes the other way for the exporter, keeping the source architecture when
`cfg.hf_architecture` carries it, and writing both rope spellings so v4 and v5 readers agree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from hybridflow.config import ModelConfig
from hybridflow.model_config import MoEConfig


@dataclass(frozen=True)
class Arch:
    """What one HF `model_type` fixes beyond the shared fields."""
    causal_lm: str  # the *ForCausalLM class
    qkv_bias: bool = False  # Q/K/V biases always present (and never on o_proj)
    qk_norm: bool = False  # q_norm / k_norm always present
    window_switch: bool = False  # the window applies only with use_sliding_window / layer_types
    o_proj_bias_flag: bool = False  # `attention_bias` biases q/k/v and o_proj: refused when true
    export_fields: dict = field(default_factory=dict)  # written by write_hf_config
    moe: bool = False  # every layer's MLP a mixture of experts (model.moe)


ARCHS = {
    "llama": Arch("LlamaForCausalLM", o_proj_bias_flag=True,
                  export_fields={"attention_bias": False, "mlp_bias": False}),
    "qwen2": Arch("Qwen2ForCausalLM", qkv_bias=True, window_switch=True,
                  export_fields={"use_sliding_window": False, "sliding_window": None}),
    "qwen3": Arch("Qwen3ForCausalLM", qk_norm=True, window_switch=True, o_proj_bias_flag=True,
                  export_fields={"attention_bias": False, "use_sliding_window": False,
                                 "sliding_window": None}),
    "mistral": Arch("MistralForCausalLM", export_fields={"sliding_window": None}),
    "qwen3_moe": Arch("Qwen3MoeForCausalLM", qk_norm=True, window_switch=True,
                      o_proj_bias_flag=True, moe=True,
                      export_fields={"attention_bias": False, "use_sliding_window": False,
                                     "sliding_window": None, "decoder_sparse_step": 1,
                                     "mlp_only_layers": []}),
}
MODEL_TYPES = {k: a.causal_lm for k, a in ARCHS.items()}
# Megatron's llama3 RoPE scaling constants (rotary_pos_embedding.RotaryEmbedding._apply_scaling).
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def load_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def config_path(path: str) -> str:
    if os.path.isdir(path):
        return os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"Hugging Face checkpoint {path} does not exist; expected a directory "
                                "with config.json and *.safetensors")
    return path


def read_hf_config(path: str) -> ModelConfig:
    """`ModelConfig` of the checkpoint directory (or config.json file) `path`."""
    cfg_file = config_path(path)
    hf_dir = os.path.dirname(os.path.abspath(cfg_file))
    cfg = hf_to_model_config(load_json(cfg_file), source=str(cfg_file),
                             name=os.path.basename(hf_dir), hf_path=hf_dir)
    check_tokenizer_vocab(hf_dir, cfg.vocab_size)
    return cfg


def hf_to_model_config(c: dict, *, source: str, name: str, hf_path: str | None = None) -> ModelConfig:
    """`ModelConfig` of the config.json contents `c`; errors name `source` (the file) and the field."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{source}: {field}={c.get(field)!r} is not supported: {why}")

    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        raise bad("model_type", f"expected one of {sorted(MODEL_TYPES)}")
    archs = c.get("architectures") or [MODEL_TYPES[model_type]]
    arch = archs[0]
    if not arch.endswith(("ForCausalLM", "ForSequenceClassification")):
        raise bad("architectures", "expected a *ForCausalLM or *ForSequenceClassification model")
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "vocab_size"):
        if not isinstance(c.get(field), int) or c[field] <= 0:
            raise bad(field, "expected a positive integer")
    if c.get("hidden_act", "silu") != "silu":
        raise bad("hidden_act", "only silu (SwiGLU) is implemented")
    if c.get("mlp_bias", False):
        raise bad("mlp_bias", "MLP biases are not implemented")
    spec = ARCHS[model_type]
    if spec.o_proj_bias_flag and c.get("attention_bias", False):
        raise bad("attention_bias", f"{model_type}'s attention_bias also biases o_proj, which is "
                  "not implemented (Q/K/V-only bias is: Qwen2)")
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    if c.get("head_dim") is None and c["hidden_size"] % heads:
        raise bad("num_attention_heads", f"does not divide hidden_size={c['hidden_size']}")
    max_pos = int(c.get("max_position_embeddings", 4096))
    _check_sliding_window(c, max_pos, bad)
    theta, scaling = _rope(c, source, bad)
    moe = _moe(c, bad) if spec.moe else MoEConfig()
    return ModelConfig(
        moe=moe, name=name, num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"], num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads, kv_channels=head_dim,
        vocab_size=c["vocab_size"], max_position_embeddings=max_pos, rotary_base=theta,
        rope_scaling=scaling, norm_epsilon=float(c.get("rms_norm_eps", 1e-6)),
        add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        hf_path=hf_path, hf_architecture=arch)


def _moe(c: dict, bad) -> MoEConfig:
    """Qwen3-MoE's expert fields: every layer sparse (decoder_sparse_step 1, no mlp_only_layers),
    no shared expert."""
    if c.get("decoder_sparse_step", 1) != 1:
        raise bad("decoder_sparse_step", "only 1 (every layer a mixture of experts) is implemented")
    if c.get("mlp_only_layers"):
        raise bad("mlp_only_layers", "dense layers among MoE layers are not implemented")
    if c.get("shared_expert_intermediate_size"):
        raise bad("shared_expert_intermediate_size", "Qwen3-MoE has no shared expert")
    experts = c.get("num_experts", c.get("num_local_experts"))
    if not isinstance(experts, int) or experts <= 0:
        raise bad("num_experts", "expected a positive integer")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(c.get(key), int) or c[key] <= 0:
            raise bad(key, "expected a positive integer")
    if c["num_experts_per_tok"] > experts:
        raise bad("num_experts_per_tok", f"more than num_experts={experts}")
    return MoEConfig(num_experts=experts, top_k=c["num_experts_per_tok"],
                     moe_ffn_hidden_size=c["moe_intermediate_size"],
                     norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                     aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.001)))


def _check_sliding_window(c: dict, max_pos: int, bad) -> None:
    window = c.get("sliding_window")
    if ARCHS[c["model_type"]].window_switch:
        layer_types = c.get("layer_types") or []
        if not c.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return
    if window is not None and window < max_pos:
        raise bad("sliding_window", f"a window smaller than max_position_embeddings={max_pos} "
                  "needs a sliding-window mask, which is not implemented")


def _rope(c: dict, cfg_file: str, bad) -> tuple[float, dict | None]:
    params = c.get("rope_parameters")  # transformers v5
    if isinstance(params, dict) and "rope_type" not in params and params and all(
            isinstance(v, dict) for v in params.values()):
        raise bad("rope_parameters", "per-layer-type RoPE parameters are not implemented")
    scaling = dict(params) if params else (dict(c["rope_scaling"]) if c.get("rope_scaling") else None)
    theta = (scaling or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    partial = (scaling or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise bad("partial_rotary_factor", "partial rotary embeddings are not implemented")
    if scaling is None:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    field = "rope_parameters" if params else "rope_scaling"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"{cfg_file}: {field}.rope_type={rope_type!r} is not supported: only "
                         "default and llama3 RoPE are implemented")
    for key, want in MEGATRON_LLAMA3.items():
        if float(scaling.get(key, want)) != want:
            raise ValueError(f"{cfg_file}: {field}.{key}={scaling[key]!r} is not supported: "
                             f"Megatron's llama3 RoPE scaling fixes it to {want:g}")
    out = {"rope_type": "llama3", "factor": float(scaling.get("factor", 8.0)), **MEGATRON_LLAMA3}
    return float(theta), out


def write_hf_config(cfg: ModelConfig, *, dtype: str = "float32") -> dict:
    """config.json contents for `cfg` (transformers v4 and v5 both read it)."""
    default = ("qwen3_moe" if cfg.moe.enabled else "qwen3" if cfg.qk_layernorm else "qwen2" if cfg.add_qkv_bias else "llama")
    arch = cfg.hf_architecture or ARCHS[default].causal_lm
    model_type = {v: k for k, v in MODEL_TYPES.items()}.get(
        arch.replace("ForSequenceClassification", "ForCausalLM"))
    if model_type is None:
        raise ValueError(f"model.hf_architecture={arch!r} is not one of {sorted(MODEL_TYPES.values())}")
    spec = ARCHS[model_type]
    if cfg.add_qkv_bias != spec.qkv_bias:
        raise ValueError(f"model.add_qkv_bias={cfg.add_qkv_bias} cannot be written as {arch}: "
                         "Q/K/V biases exist exactly in Qwen2")
    if cfg.qk_layernorm != spec.qk_norm:
        raise ValueError(f"model.qk_layernorm={cfg.qk_layernorm} cannot be written as {arch}: "
                         "q/k norms exist exactly in Qwen3")
    if cfg.moe.enabled != spec.moe:
        raise ValueError(f"model.moe.num_experts={cfg.moe.num_experts} cannot be written as "
                         f"{arch}: mixtures of experts are written as Qwen3MoeForCausalLM only")
    if cfg.moe.shared_expert_ffn_hidden_size:
        raise ValueError("model.moe.shared_expert_ffn_hidden_size > 0 cannot be written as "
                         f"{arch}: Qwen3-MoE has no shared expert")
    head_dim = cfg.head_dim
    rope = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": float(cfg.rotary_base)}
    out = {
        "architectures": [arch], "model_type": model_type,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": float(cfg.rotary_base),
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling
        else None,
        "rope_parameters": rope, "dtype": dtype, "torch_dtype": dtype,
    }
    out.update(spec.export_fields)
    if spec.moe:
        m = cfg.moe
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=m.moe_ffn_hidden_size, norm_topk_prob=m.norm_topk_prob,
                   router_aux_loss_coef=m.aux_loss_coeff, output_router_logits=False)
    return out


def tokenizer_vocab_size(tokenizer_json: str) -> int:
    """1 + the largest token id in tokenizer.json (model vocab and added tokens)."""
    data = load_json(tokenizer_json)
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t["id"] for t in data.get("added_tokens") or [] if "id" in t]
    return max(ids) + 1 if ids else 0


def check_tokenizer_vocab(hf_dir: str, vocab_size: int) -> None:
    """A tokenizer that can emit ids >= the embedding's rows would index out of range: refuse it."""
    tok = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(tok):
        return
    n = tokenizer_vocab_size(tok)
    if n > vocab_size:
        raise ValueError(f"{tok} has {n} tokens but {os.path.join(hf_dir, 'config.json')} has "
                         f"vocab_size={vocab_size}: the tokenizer does not match the model")
