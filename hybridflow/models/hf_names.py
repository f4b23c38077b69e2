"""Hugging Face <-> Megatron parameter names, and the Megatron -> HF conversion of full tensors.

Shared by the loader (`hf.py`, which shards HF tensors per TP rank) and the saver (`hf_save.py`,
which writes gathered weights), so neither imports the other. The map (HF `model.layers.{i}.` ->
Megatron `decoder.layers.{i}.`) is documented in `hf.py`; `megatron_to_hf_state_dict` undoes its
packing: [gate; up] -> gate_proj, up_proj (each expert's too: Qwen3-MoE's
`mlp.experts.<e>.{gate,up,down}_proj`, the router `mlp.gate`); QKV grouped per query group [q heads of g; k_g; v_g] ->
q_proj, k_proj, v_proj; vocab padding stripped; no lm_head when the embeddings are tied.
"""

from __future__ import annotations

from typing import Mapping

import torch

from hybridflow.model_config import ModelConfig
from hybridflow.parallel import param_rules as pr

LAYER_HF = {  # Megatron layer suffix -> HF layer suffix, for tensors copied without repacking
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # (head_dim,), Qwen3
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
TE_ALIASES = {  # transformer-engine spec fuses the norms into the next linear
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def dims(cfg: ModelConfig) -> tuple[int, int]:
    """(head dim, query heads per KV group)."""
    return cfg.head_dim, cfg.num_attention_heads // cfg.num_query_groups


def expert_suffix(suffix: str) -> tuple[int, str] | None:
    """(expert, "linear_fc1" | "linear_fc2") of a layer suffix naming an expert's weight
    (SequentialMLP's or TEGroupedMLP's spelling), else None."""
    e = pr.expert_index(suffix)
    if e is None:
        return None
    return e, ("linear_fc1" if "linear_fc1" in suffix else "linear_fc2")


def mlp_param_names(cfg: ModelConfig) -> list[str]:
    """A layer's MLP parameters (layer suffixes): dense fc1/fc2, or the MoE router and experts
    (SequentialMLP's names, global expert indices)."""
    if not cfg.moe.enabled:
        return ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    return ["mlp.router.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc{k}.weight"
                                    for e in range(cfg.moe.num_experts) for k in (1, 2)]


def megatron_param_names(cfg: ModelConfig) -> list[str]:
    """Global names of the full LM (PP=1) in GPTModel order; output_layer only when untied."""
    layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight",
             *(["self_attention.linear_qkv.bias"] if cfg.add_qkv_bias else []),
             *(["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
               if cfg.qk_layernorm else []),
             "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
             *mlp_param_names(cfg)]
    return (["embedding.word_embeddings.weight"]
            + [f"decoder.layers.{i}.{s}" for i in range(cfg.num_layers) for s in layer]
            + ["decoder.final_layernorm.weight"]
            + ([] if cfg.tie_word_embeddings else ["output_layer.weight"]))


def megatron_to_hf_state_dict(full_sd: Mapping[str, torch.Tensor],
                              cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron_state_dict`: HF names, vocab padding stripped, no lm_head when
    tied (transformers re-ties it on load)."""
    hd, hpg = dims(cfg)
    G, V = cfg.num_query_groups, cfg.vocab_size
    out = {}
    for name, t in full_sd.items():
        layer = pr.layer_index(name)
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[:V]
        elif name == "output_layer.weight":
            if not cfg.tie_word_embeddings:
                out["lm_head.weight"] = t[:V]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif layer is None:
            raise ValueError(f"cannot export Megatron parameter {name!r} to Hugging Face "
                             "(scalar value heads are not exported)")
        else:
            suffix = name.split(f"decoder.layers.{layer}.", 1)[1]
            suffix = TE_ALIASES.get(suffix, suffix)
            p = f"model.layers.{layer}."
            expert = expert_suffix(suffix)
            if suffix in LAYER_HF:
                out[p + LAYER_HF[suffix]] = t
            elif suffix == "mlp.router.weight":
                out[p + "mlp.gate.weight"] = t
            elif expert is not None:
                q = p + f"mlp.experts.{expert[0]}."
                if expert[1] == "linear_fc1":
                    out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = t.chunk(2, 0)
                else:
                    out[q + "down_proj.weight"] = t
            elif suffix == "mlp.linear_fc1.weight":
                out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = t.chunk(2, 0)
            elif suffix.startswith("self_attention.linear_qkv."):
                kind = suffix.rsplit(".", 1)[1]
                grouped = t.reshape(G, (hpg + 2) * hd, *t.shape[1:])
                q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
                for n, x in zip("qkv", (q, k, v)):
                    out[p + f"self_attn.{n}_proj.{kind}"] = x.reshape(-1, *t.shape[1:])
            else:
                raise ValueError(f"cannot export Megatron parameter {name!r} to Hugging Face")
    return out
