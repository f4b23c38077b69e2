"""parallel.fused_elementwise: the training passes' RoPE and SwiGLU as fused kernels on CUDA.

Megatron's local layer spec runs both unfused: RoPE as t * cos + cat(-t2, t1) * sin plus a concat
with an empty pass-through part (about ten element-wise kernels per layer for q and k), and the
gated MLP as silu(gate), then up + glu_linear_offset (a full copy even at offset 0), then their
product, keeping the silu output and that copy for backward. Each is a memory-bound pass over an
activation-sized tensor, so together they cost a large share of a small model's pass (about a third
of a forward-only pass at Qwen2-1.5B; docs/perf_log.md). With this on (the default; CUDA tensors
only, the CPU path is unchanged):
- SwiGLU: Megatron's own fusion (`bias_activation_fusion`: `SwiGLUFunction`, torch.compile'd
  forward and backward kernels that keep only fc1's output for backward);
- RoPE: Megatron's bshd RoPE (rotate-half, whole head) through torch.compile (one kernel
  forward, one backward; dynamic shapes) over its cos / sin tables made once per `freqs` tensor
  (all layers of a pass share them), installed
  in place of the unfused function that
  `megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb` calls (interleaved,
  MLA and partial rotations keep Megatron's own).
parallel.elementwise_kernels picks whose kernels run the RMSNorm and that SwiGLU on CUDA:
- "torch": torch's RMSNorm and Megatron's compiled SwiGLU;
- "liger": liger-kernel's Triton kernels (its Megatron integration's choices): the RMSNorm in fp32
  throughout as torch's CUDA kernel computes it ("gemma" casting), its weight gradient summed per SM
  in the backward kernel instead of a separate reduction; the SwiGLU read from fc1's [gate | up]
  output in place, recomputing silu in the backward;
- "auto": liger where it is installed.
transformer-engine, where installed, has its own fused RoPE and SwiGLU (its layer spec).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.common.embeddings import rope_utils

from hybridflow.config_checks import have_liger
from hybridflow.models.graphs import capturing

_UNFUSED_ROPE = rope_utils._apply_rotary_pos_emb_bshd


def elementwise_kernels(option: str) -> str:
    """parallel.elementwise_kernels resolved: "liger" or "torch"."""
    if option == "auto":
        return "liger" if have_liger() else "torch"
    return option


def use_swiglu_kernel(kind: str) -> None:
    """Process-wide, as use_fused_rope: the SwiGLU that Megatron's fused MLP path calls (its
    module-level SwiGLUFunction, read by bias_swiglu_impl at every call) is liger's for CUDA
    tensors (`kind` "liger") or Megatron's own."""
    from megatron.core.fusions import fused_bias_swiglu

    fused_bias_swiglu.SwiGLUFunction = _LigerSwiGLU if kind == "liger" else _MEGATRON_SWIGLU


def _megatron_swiglu():
    from megatron.core.fusions import fused_bias_swiglu

    f = fused_bias_swiglu.SwiGLUFunction
    return getattr(f, "megatron", f)


class _LigerSwiGLU:
    """Megatron's SwiGLUFunction.apply signature over liger's fused gate-up kernel; fp8 input
    storage, CPU activation offload and CPU tensors keep Megatron's."""

    @staticmethod
    def apply(x, fp8_input_store=False, cpu_offload_input=False):
        if fp8_input_store or cpu_offload_input or not x.is_cuda:
            return _MEGATRON_SWIGLU.apply(x, fp8_input_store, cpu_offload_input)
        from liger_kernel.ops import LigerFusedGateUpSiLUMulFunction

        return LigerFusedGateUpSiLUMulFunction.apply(x, False)


_MEGATRON_SWIGLU = _megatron_swiglu()
_LigerSwiGLU.megatron = _MEGATRON_SWIGLU


def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm by liger's kernel, computed as torch's CUDA RMSNorm does (fp32 throughout, one
    rounding to x's dtype); dY is not overwritten by the backward (in_place=False), as in liger's
    Megatron integration."""
    from liger_kernel.ops import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "gemma", False, None)


def use_fused_rope(enabled: bool) -> None:
    """Process-wide: Megatron's RoPE (bshd layout) compiled on CUDA tensors, or as shipped."""
    rope_utils._apply_rotary_pos_emb_bshd = _fused_rope if enabled else _UNFUSED_ROPE
    _TABLES.clear()


@functools.cache
def _compiled_rope():
    return torch.compile(_rope_from_tables, dynamic=True)


def _rope_from_tables(t, cos, sin):
    """Megatron's bshd RoPE (rotate-half, the whole head rotated) given its cos / sin tables."""
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


def _fused_rope(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
    partial = freqs.shape[-1] != t.shape[-1]
    if not t.is_cuda or rotary_interleaved or multi_latent_attention or partial:
        return _UNFUSED_ROPE(t, freqs, rotary_interleaved=rotary_interleaved,
                             multi_latent_attention=multi_latent_attention, mscale=mscale)
    return _compiled_rope()(t, *_TABLES.get(freqs, t.dtype, mscale))


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
