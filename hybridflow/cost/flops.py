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


def lora_adapted_linears(shape: ModelConfig, tp: int = 1) -> list[tuple[int, int]]:
    """(input, output) widths of the weights all-linear LoRA adapts in a layer on one of `tp`
    ranks, one adapter per fused linear (models/lora.py: q/k/v share linear_qkv's, gate/up
    linear_fc1's): the column-parallel qkv and fc1 split their outputs, the row-parallel proj and
    fc2 their inputs."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    qkv = shape.q_dim + 2 * shape.kv_dim
    return [(h, qkv // tp), (shape.q_dim // tp, h), (h, 2 * f // tp), (f // tp, h)]


def lora_bytes_per_token_layer(shape: ModelConfig, tp: int = 1) -> tuple[float, float]:
    """(forward, backward) bytes of bf16 activations the LoRA adapters' GEMMs read and write per
    token and layer on one of `tp` ranks, beyond the base linears': forward, h = x A^T reads the
    input and out + h (s B)^T reads and writes the base's output (in + 2 out); backward,
    dh = g (s B) and dB read the output gradient, dA reads the input again and dx += dh A reads and
    writes the input gradient (3 in + 2 out). The rank-r tensors are negligible; at a small rank
    the GEMMs are bound by these reads, not by their FLOPs (timing: `inv_lora_bw_eff`). Sequence
    parallelism (the model's TP > 1) splits each of these tensors over TP, by features or by
    sequence."""
    fwd = bwd = 0.0
    for n_in, n_out in lora_adapted_linears(shape):
        fwd += BYTES_PER_PARAM * (n_in + 2 * n_out)
        bwd += BYTES_PER_PARAM * (3 * n_in + 2 * n_out)
    return fwd / tp, bwd / tp


# The LoRA merge before generation (models/lora.py merged_adapters), bytes per adapted weight, in
# row blocks of LORA_MERGE_BLOCK_ROWS: D = B A written in fp32 (4); W upcast (2 read, 4 written),
# W + D (8 read, 4 written) and rounded to bf16 (4 read, 2 written): 24; the same back from the
# merged block (24); the two bf16 results' bits compared (4 read, 1 written) and the mask scanned
# (1); the merged block copied in (4): 62. Each block also costs its launches
# (`lora_merge_block_s`, fitted when every block made the host wait for its nonzero(); the merge
# now waits once per many blocks, so the term is an upper bound until refitted). The restore after
# generation recomputes D and subtracts it (4 + 24, copied in: 4 more) and waits for nothing.
LORA_MERGE_BYTES_PER_PARAM = 62
LORA_UNMERGE_BYTES_PER_PARAM = 32
LORA_MERGE_BLOCK_ROWS = 4096


def lora_merge_work(shape: ModelConfig, tp: int = 1) -> tuple[int, int]:
    """(adapted weights, row blocks) of one rank's all-linear LoRA merge: every layer's qkv,
    proj, fc1 and fc2 weights (out x in on this rank), in blocks of LORA_MERGE_BLOCK_ROWS rows."""
    params = blocks = 0
    for n_in, n_out in lora_adapted_linears(shape, tp):
        params += n_in * n_out
        blocks += math.ceil(n_out / LORA_MERGE_BLOCK_ROWS)
    return shape.num_layers * params, shape.num_layers * blocks


def decode_flops_per_token(shape: ModelConfig, context: float) -> float:
    """One generated token attending to `context` cached positions (MoE: every expert, as the
    in-place decode step runs them; ModelConfig.num_decode_params)."""
    return 2 * shape.num_decode_params + 4 * shape.num_layers * shape.q_dim * context


def kv_heads_per_gpu(shape: ModelConfig, tp: int) -> int:
    # TP shards the KV groups; with more TP ranks than groups each rank keeps a replica of one.
    return math.ceil(shape.num_query_groups / tp)


# rollout.kv_cache_dtype=fp8 (kernels/kv_fp8.py): a byte per value plus an fp32 scale per token
# and KV head
KV_FP8_SCALE_BYTES = 4


def kv_bytes_per_token(shape: ModelConfig, tp: int = 1, *, fp8: bool = False) -> int:
    """K and V of every layer for one cached token, on one of `tp` ranks (bf16, or fp8 codes and
    their scales)."""
    per_head = shape.head_dim + KV_FP8_SCALE_BYTES if fp8 else shape.head_dim * BYTES_PER_PARAM
    return 2 * shape.num_layers * kv_heads_per_gpu(shape, tp) * per_head


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


def elementwise_bytes_per_token_layer(shape: ModelConfig, tp: int = 1, *,
                                      fused: bool = True) -> tuple[float, float]:
    """(forward, backward) bytes of bf16 activations the layer's element-wise (bandwidth-bound)
    kernels read and write per token on one of `tp` ranks: what a pass costs beyond its GEMMs'
    and attention's FLOPs (timing: `inv_elementwise_bw_eff`, at HBM bandwidth). Per token, in
    elements (h hidden, q / kv the query / key-value widths, f the FFN width; weights and
    per-token statistics such as RMSNorm's rstd are negligible):
    forward
      - the two RMSNorms: input read, output written: 2 x 2h = 4h
      - the two residual adds: two inputs read, the sum written: 2 x 3h = 6h
      - RoPE over q and k: read and written: 2(q + kv)
      - fused SwiGLU: fc1's output (gate, up: 2f) read, f written: 3f
      = 10h + 2q + 2kv + 3f
    backward
      - each RMSNorm: output gradient and saved input read, input gradient written: 2 x 3h = 6h
      - the gradients meeting where the residual branches (norm input = residual): two read,
        the sum written: 2 x 3h = 6h
      - RoPE: q and k gradients read and written: 2(q + kv)
      - SwiGLU: its output gradient (f) and saved input (2f) read, gate / up gradients (2f)
        written: 5f
      = 12h + 2q + 2kv + 5f
    Unfused (parallel.fused_elementwise false), Megatron's SwiGLU is silu (f read, f written) then
    a product (2f read, f written): 5f forward, about 8f backward; its RoPE (t cos + rotate_half(t)
    sin: a negation, a cat, two products, an add) moves about 9 elements per element of q and k,
    either way. The q/k norms (qk_layernorm) add 2(q + kv) forward, 3(q + kv) backward. MoE: the
    MLP's SwiGLU is per dispatched row (top_k rows of f_e) plus the shared expert's. Sequence
    parallelism (TP > 1) splits all of it over TP (the hidden-width tensors by sequence, the
    q/kv/f ones by features). The LM head's log-prob kernels (per token, not per layer) are left
    out. On a profiled 0.5B packed update (docs/perf_log.md) these kernels (SwiGLU, RMSNorm, RoPE,
    other element-wise: 0.40 s) move about half the HBM bandwidth's worth of these bytes."""
    h = shape.hidden_size
    qk = shape.q_dim + shape.kv_dim
    rope = 2 if fused else 9
    m = shape.moe
    if m.enabled:
        f = m.top_k * m.moe_ffn_hidden_size + (m.shared_expert_ffn_hidden_size or 0)
    else:
        f = shape.ffn_hidden_size
    fwd = 10 * h + rope * qk + (3 if fused else 5) * f
    bwd = 12 * h + rope * qk + (5 if fused else 8) * f
    if shape.qk_layernorm:
        fwd += 2 * qk
        bwd += 3 * qk
    return BYTES_PER_PARAM * fwd / tp, BYTES_PER_PARAM * bwd / tp
