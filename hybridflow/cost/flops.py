"""FLOPs per token and bytes per token: the counts every timing formula starts from.

N is `ModelConfig.num_dense_params`: the weights that take part in a matmul for every token, i.e. the
layers' QKV, output, gate, up and down projections plus the LM head (V x h); biases, norms (also
Qwen3's q/k norms) and the embedding lookup are left out (for the critic, the LM head is replaced by
its h x 1 value head). Widths come from head_dim (`q_dim`, `kv_dim`), which need not be
hidden / heads (Qwen3: 16 x 128 = 2048 for hidden 1024).
A matmul costs 2 FLOPs per weight per token forward and 4 backward, hence 2N forward and 6N fwd+bwd.

Attention (QK^T and AV): a token at context c costs 4 * q_dim * c FLOPs per layer forward. Causal
attention over a sequence of length s has mean context s/2 (flash attention skips the masked half),
so per token: forward 2 * L * s * q_dim, fwd+bwd 6 * L * s * q_dim ("6 * n_layers * seq * hidden",
q_dim = heads x head_dim = hidden for most models; the 12 * L * s * h of the Megatron paper is the
same count without the causal saving). Full recompute adds one more forward: 8N + 8 L s q_dim.
"""
from __future__ import annotations

import math

from hybridflow.model_config import ModelConfig

BYTES_PER_PARAM = 2     # bf16 / fp16 weights
# bytes per layer-matmul weight a quantized rollout's decode step reads (rollout.quantization): fp8
# codes (the per-channel scales negligible), int4 codes + a bf16 scale and offset per 128 weights;
# the LM head and embedding stay at BYTES_PER_PARAM
ROLLOUT_BYTES_PER_WEIGHT = {"none": BYTES_PER_PARAM, "fp8": 1.0, "int4": 0.5 + 4 / 128}


def dense_params(shape: ModelConfig, role: str = "actor") -> int:
    if role == "critic":
        return shape.num_layers * shape.layer_matmul_params + shape.hidden_size
    return shape.num_dense_params


def forward_flops_per_token(shape: ModelConfig, seq_len: int, role: str = "actor",
                            head_fraction: float = 1.0) -> float:
    """`head_fraction`: the share of the tokens whose LM head (V x h) is computed. The engine
    computes logits only at the positions that predict response tokens (response_len / seq_len
    of them; `Workload.head_fraction`). The generator's prefill needs the last position only but is
    still charged the full head (timing._gen; the calibration was fitted so)."""
    head = 0 if role == "critic" else shape.embedding_params * (1.0 - head_fraction)
    return 2 * (dense_params(shape, role) - head) + 2 * shape.num_layers * seq_len * shape.q_dim


def train_flops_per_token(shape: ModelConfig, seq_len: int, role: str = "actor",
                          recompute: bool = False, head_fraction: float = 1.0) -> float:
    passes = 4 if recompute else 3     # fwd + bwd (2x fwd) [+ recomputed fwd]
    return passes * forward_flops_per_token(shape, seq_len, role, head_fraction)


def decode_flops_per_token(shape: ModelConfig, context: float) -> float:
    """One generated token attending to `context` cached positions (MoE: every expert, as the
    in-place decode step runs them; ModelConfig.num_decode_params)."""
    return 2 * shape.num_decode_params + 4 * shape.num_layers * shape.q_dim * context


def kv_heads_per_gpu(shape: ModelConfig, tp: int) -> int:
    # TP shards the KV groups; with more TP ranks than groups each rank keeps a replica of one.
    return math.ceil(shape.num_query_groups / tp)


def kv_bytes_per_token(shape: ModelConfig, tp: int = 1) -> int:
    """K and V of every layer for one cached token, on one of `tp` ranks."""
    return 2 * shape.num_layers * kv_heads_per_gpu(shape, tp) * shape.head_dim * BYTES_PER_PARAM


def activation_bytes_per_token_layer(shape: ModelConfig, *, fused_swiglu: bool = True) -> int:
    """bf16 tensors one layer keeps for backward per token (no dropout, flash attention: no scores).

    norm input h + QKV input h + Q,K,V (q + 2kv) + attention output q + MLP norm input h + fc1 input h
    + gate,up 2f + SwiGLU output f  =  4h + 2q + 2kv + 3f elements (Korthikanti et al. 2022, redone
    for GQA + SwiGLU). Megatron's unfused SwiGLU (`fused_swiglu` false) also keeps silu(gate) and
    its copy of `up` (+ glu_linear_offset): 2f more. The q/k norms (`qk_layernorm`, Qwen3) keep
    their inputs, Q and K before the norm: q + kv more (RoPE, a product with fixed tables, keeps
    nothing of its own). Sequence parallelism shards all of it over TP.
    MoE: the MLP's tensors are per dispatched row, top_k rows per token: fc1 input top_k h (in
    place of h), gate,up and SwiGLU output top_k x 3 f_e (5 unfused), plus the router's fp32 logits
    (E) and the shared expert's as a dense MLP's."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    qk_norm_inputs = shape.q_dim + shape.kv_dim if shape.qk_layernorm else 0
    attn = 3 * h + 2 * shape.q_dim + 2 * shape.kv_dim + qk_norm_inputs
    swiglu = 3 if fused_swiglu else 5
    m = shape.moe
    if not m.enabled:
        return BYTES_PER_PARAM * (attn + h + swiglu * f)
    mlp = m.top_k * (h + swiglu * m.moe_ffn_hidden_size) + 2 * m.num_experts
    mlp += (h + swiglu * m.shared_expert_ffn_hidden_size) if m.shared_expert_ffn_hidden_size else 0
    return BYTES_PER_PARAM * (attn + mlp)
