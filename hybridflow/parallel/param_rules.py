"""How each Megatron GPTModel parameter is split over tensor parallelism, and layer renaming over PP.

One table answers "which rule does this parameter follow" for every consumer: the HF importer/exporter
(full tensor <-> TP shard), the reshard plan (train shards -> gen shard), checkpoint tools and tests.

Rules (local and TE specs of a Llama/Qwen2-style GPTModel):
- `vocab`:      embedding.word_embeddings.weight, output_layer.weight; split on dim 0 (padded vocab).
- `column`:     linear_qkv.{weight,bias}; split on dim 0. Megatron stores QKV grouped by query group
                ([q of group 0; k0; v0; q of group 1; ...]) and TP keeps whole groups, so the full tensor
                is the plain concatenation of the shards.
- `gated_fc1`:  mlp.linear_fc1.weight with a gated unit: each shard holds [gate_r; up_r], so the full
                tensor [gate; up] is NOT the concatenation: shard r = [gate.chunk(tp)[r]; up.chunk(tp)[r]].
- `row`:        linear_proj.weight, linear_fc2.weight; split on dim 1.
- MoE layers (model.moe): `mlp.router.weight` (E x hidden) is `replicated`; each expert's
                `linear_fc1` / `linear_fc2` follow `gated_fc1` / `row` over the expert TP group
                (its size, not the attention's TP, is the `tp_size` to pass). Experts are split over
                expert parallelism (EP) whole: EP rank r holds experts r*E/EP .. (r+1)*E/EP-1 as its
                local experts 0..E/EP-1 (`global_expert_name` / `local_expert_name` rename them;
                SequentialMLP's `experts.local_experts.<j>.` and TEGroupedMLP's `weight<j>`).
- `replicated`: norms (also Qwen3's per-head q/k norms, `q_layernorm` / `k_layernorm`: one (head_dim,)
                weight shared by every head), biases of row-parallel layers, the scalar value head;
                identical on every rank.
LoRA adapters (models/lora.py) follow their base layer: `lora.B.<name>` of a column-parallel
linear (qkv, fc1: one pair per PEFT target, so no gate/up interleave) is `column`, `lora.A.<name>`
of a row-parallel one (proj, fc2) is `row`; the other factor is `replicated`.
"""

from __future__ import annotations

import re

import torch

VOCAB, COLUMN, GATED_FC1, ROW, REPLICATED = "vocab", "column", "gated_fc1", "row", "replicated"

_RULES = (
    (r"\.lora\.B\.(q|k|v|gate|up)_proj$", COLUMN),
    (r"\.lora\.A\.(o|down)_proj$", ROW),
    (r"\.lora\.[AB]\.\w+$", REPLICATED),
    (r"(^|\.)embedding\.word_embeddings\.weight$", VOCAB),
    (r"(^|\.)output_layer\.weight$", VOCAB),
    (r"\.linear_qkv\.(weight|bias)$", COLUMN),
    (r"\.linear_fc1\.weight$", GATED_FC1),
    (r"\.linear_proj\.weight$", ROW),
    (r"\.linear_fc2\.weight$", ROW),
    (r"\.experts\.linear_fc1\.weight\d+$", GATED_FC1),  # TEGroupedMLP
    (r"\.experts\.linear_fc2\.weight\d+$", ROW),
    (r"\.mlp\.router\.weight$", REPLICATED),
    (r"(layernorm|layer_norm)[^.]*\.(weight|bias)$", REPLICATED),
    (r"output_layer\.linear\.(weight|bias)$", REPLICATED),
)

_LAYER = re.compile(r"(decoder\.layers\.)(\d+)(\.)")
_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)|(\.experts\.linear_fc[12]\.weight)(\d+)$")


def param_rule(name: str) -> str:
    """The TP rule of a parameter by its name in GPTModel.named_parameters()."""
    for pattern, rule in _RULES:
        if re.search(pattern, name):
            return rule
    raise ValueError(f"no tensor-parallel rule for parameter {name!r}")


def split_dim(rule: str) -> int | None:
    return {VOCAB: 0, COLUMN: 0, GATED_FC1: 0, ROW: 1}.get(rule)


def shard_tensor(name: str, full: torch.Tensor, *, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of a full (unsharded) parameter, as a view where possible."""
    rule = param_rule(name)
    if rule == REPLICATED or tp_size == 1:
        return full
    if rule == GATED_FC1:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
    dim = split_dim(rule)
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} is not divisible by "
                         f"TP={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank]


def merge_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of shard_tensor: the full parameter from the shards of TP ranks 0..n-1."""
    rule = param_rule(name)
    if rule == REPLICATED or len(shards) == 1:
        return shards[0]
    if rule == GATED_FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(shards, dim=split_dim(rule))


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(2)) if m else None


def shift_layer(name: str, offset: int) -> str:
    """Rename decoder.layers.<i>. to decoder.layers.<i+offset>. (local <-> global over PP)."""
    return _LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name)


def stage_of_layer(global_layer: int, *, num_layers: int, pp_size: int) -> int:
    return global_layer // (num_layers // pp_size)


def global_name(name: str, *, pp_rank: int, num_layers: int, pp_size: int) -> str:
    return shift_layer(name, pp_rank * (num_layers // pp_size))


def local_name(name: str, *, pp_rank: int, num_layers: int, pp_size: int) -> str:
    return shift_layer(name, -pp_rank * (num_layers // pp_size))


def expert_index(name: str) -> int | None:
    """The expert index in an MoE expert parameter's name (None for any other parameter)."""
    m = _EXPERT.search(name)
    return None if m is None else int(m.group(2) if m.group(2) is not None else m.group(5))


def shift_expert(name: str, offset: int) -> str:
    def sub(m):
        if m.group(2) is not None:
            return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}"
        return f"{m.group(4)}{int(m.group(5)) + offset}"
    return _EXPERT.sub(sub, name)


def global_expert_name(name: str, *, ep_rank: int, num_experts: int, ep_size: int) -> str:
    """Local expert j of EP rank r -> expert r * E/EP + j (other names unchanged)."""
    return shift_expert(name, ep_rank * (num_experts // ep_size))


def local_expert_name(name: str, *, ep_rank: int, num_experts: int, ep_size: int) -> str:
    return shift_expert(name, -ep_rank * (num_experts // ep_size))


def ep_rank_of_expert(expert: int, *, num_experts: int, ep_size: int) -> int:
    return expert // (num_experts // ep_size)
