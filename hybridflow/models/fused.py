"""parallel.fused_elementwise: the training passes' RoPE and SwiGLU as fused kernels on CUDA.

Megatron's local layer spec runs both unfused: RoPE as t * cos + cat(-t2, t1) * sin plus a concat
with an empty pass-through part (about ten element-wise kernels per layer for q and k), and the
gated MLP as silu(gate), then up + glu_linear_offset (a full copy even at offset 0), then their
product, keeping the silu output and that copy for backward. Each is a memory-bound pass over an
activation-sized tensor, so together they cost a large share of a small model's pass (about a third
of a forward-only pass at Qwen2-1.5B; docs/perf_log.md). With this on (the default; CUDA tensors
only, the CPU path is unchanged):
- SwiGLU: Megatron's own fusion (`bias_activation_fusion`: `SwiGLUFunction`, torch.compile'd
  forward and backward kernels that keep only fc1's output for backward); with
  `parallel.swiglu_backward=triton` its backward on kernels/swiglu_train.py (`use_fused_swiglu`:
  the same forward, installed in place of the `bias_swiglu_impl` that Megatron's MLP calls;
  biased, fp8-stored or offloaded inputs keep Megatron's);
- RoPE: Megatron's bshd RoPE (rotate-half, whole head) as one kernel each way, ours
  (kernels/rope_train.py: every head of a position rotated with one read of its tables) where it
  takes the head size (head_dim / 2 a power of two), else its formula through torch.compile (one
  kernel per q and k each way; dynamic shapes); over cos / sin tables made once per `freqs`
  tensor (all layers of a pass share them), installed in place of the unfused function that
  `megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb` calls (interleaved,
  MLA and partial rotations keep Megatron's own). With `parallel.rope_from_qkv` the kernel reads q
  where the QKV projection put it, in its KV groups (`use_rope_from_qkv`), instead of the copy
  that Megatron's reshape to (S, B, H, D) makes of it in every layer's forward wherever there are
  several groups (GQA).
transformer-engine, where installed, has its own fused RoPE and SwiGLU (its layer spec).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import mlp as megatron_mlp
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp

from hybridflow.kernels import rope_train, swiglu_train
from hybridflow.models.graphs import capturing

_UNFUSED_ROPE = rope_utils._apply_rotary_pos_emb_bshd
_MEGATRON_SWIGLU = fused_bias_swiglu.bias_swiglu_impl
_MEGATRON_QKV = SelfAttention.get_query_key_value_tensors


def use_fused_swiglu(enabled: bool) -> None:
    """Process-wide: the fused SwiGLU that Megatron's MLP calls with its backward on
    kernels/swiglu_train.py (`_swiglu`), or Megatron's own."""
    megatron_mlp.bias_swiglu_impl = _swiglu if enabled else _MEGATRON_SWIGLU


def _swiglu(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """Megatron's bias_swiglu_impl, its bias-free case with the Triton backward on CUDA."""
    if bias is not None or fp8_input_store or cpu_offload_input or not input.is_cuda:
        return _MEGATRON_SWIGLU(input, bias, fp8_input_store, cpu_offload_input)
    shape = input.shape
    out = _SwiGLU.apply(input.reshape(-1, shape[-1]))
    return out if len(shape) == 2 else out.view(*shape[:-1], -1)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of z = [gate | up]: Megatron's compiled forward, keeping z alone."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return fused_bias_swiglu.swiglu(z)

    @staticmethod
    def backward(ctx, grad):
        (z,) = ctx.saved_tensors
        grad = grad.reshape(z.shape[0], -1)
        if not swiglu_train.supported(grad, z):  # a strided or other-dtype gradient
            return fused_bias_swiglu.swiglu_back(grad, z)
        return swiglu_train.swiglu_backward(grad, z)


def use_fused_rope(enabled: bool) -> None:
    """Process-wide: Megatron's RoPE (bshd layout) on CUDA tensors as one kernel each way
    (`_fused_rope`), or as shipped."""
    rope_utils._apply_rotary_pos_emb_bshd = _fused_rope if enabled else _UNFUSED_ROPE
    _TABLES.clear()


@functools.cache
def _compiled_rope():
    """Megatron's bshd RoPE given its tables (rope_train.rope_twin), compiled."""
    return torch.compile(rope_train.rope_twin, dynamic=True)


def _fused_rope(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
    """Megatron's bshd RoPE of t (S, B, H, D), or of q (S, B, G, H / G, D) as the QKV projection
    groups it (`use_rope_from_qkv`), -> (S, B, H, D)."""
    partial = freqs.shape[-1] != t.shape[-1]
    if not t.is_cuda or rotary_interleaved or multi_latent_attention or partial:
        return _UNFUSED_ROPE(rope_train.heads(t), freqs, rotary_interleaved=rotary_interleaved,
                             multi_latent_attention=multi_latent_attention, mscale=mscale)
    cos, sin = _TABLES.get(freqs, t.dtype, mscale)
    if rope_train.supported(t, cos):
        return rope_train.rope(t, cos, sin, impl="triton")
    return _compiled_rope()(rope_train.heads(t), cos, sin)


def use_rope_from_qkv(enabled: bool) -> None:
    """Process-wide, with `use_fused_rope(True)` only: SelfAttention hands q to the RoPE as the QKV
    projection groups it, (S, B, G, H / G, D), a view, instead of reshaping it to (S, B, H, D),
    a copy wherever G > 1; `_fused_rope` rotates it into (S, B, H, D) in one pass."""
    SelfAttention.get_query_key_value_tensors = (_qkv_grouped_query if enabled
                                                 else _MEGATRON_QKV)


def _qkv_grouped_query(self, hidden_states, key_value_states=None, output_gate=False,
                       split_qkv=True):
    """Megatron's get_query_key_value_tensors with q left in the projection's groups. Its own
    path where q needs more than the split: an output gate, a q / k norm (over (S, B, H, D)), the
    query groups spread over more TP ranks than there are groups, or the unsplit tensor asked."""
    c = self.config
    norms = [m for m in (self.q_layernorm, self.k_layernorm)
             if m is not None and not isinstance(m, IdentityOp)]
    if (output_gate or not split_qkv or norms or c.num_query_groups < self.world_size
            or c.test_mode):
        return _MEGATRON_QKV(self, hidden_states, key_value_states, output_gate, split_qkv)
    mixed, sizes = _MEGATRON_QKV(self, hidden_states, key_value_states, False, False)
    query, key, value = torch.split(mixed, sizes, dim=3)  # (S, B, G, hpg * D), (S, B, G, D) x 2
    return query.unflatten(3, (-1, self.hidden_size_per_attention_head)), key, value


class _RopeTables:
    """cos / sin tables of the last `freqs` seen, as Megatron rounds them ((s, 1, 1, hd): small;
    compiled with them inside, inductor evaluated cos and sin for every element of t). Every layer
    of a pass rotates q and k by the same `freqs` tensor: made once, not 2 x layers times (six
    launches each). Fresh while a CUDA graph is captured: the graph must compute them from its
    static input at every replay, not read a table made before the capture."""

    def __init__(self):
        self.clear()

    def get(self, freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
        fresh = capturing()
        key = (freqs._version, dtype, mscale)
        if not fresh and freqs is self._freqs and key == self._key:
            return self._tables
        tables = ((torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype))
        if not fresh:
            self._freqs, self._key, self._tables = freqs, key, tables
        return tables

    def clear(self) -> None:
        self._freqs = self._key = self._tables = None


_TABLES = _RopeTables()
