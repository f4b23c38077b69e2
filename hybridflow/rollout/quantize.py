"""Quantized rollout weights (rollout.quantization): the decoder's four matmul weights per layer
(qkv, proj, fc1, fc2) as fp8 or int4, quantized from the generation weights once per step.

- "fp8": E4M3 codes (N, K) with one fp32 scale per output channel (amax / 448); the activations
  quantized per token (row) the same way at each GEMM (kernels.quant.quant_rows_fp8, one pass),
  then torch._scaled_mm with row-wise scales on both sides, bf16 out. Half the bf16 weight bytes.
  Decode batches of at most rollout.kernel_options.fp8_weight_only_max_rows rows may instead run
  the codes weight-only (widened to bf16 in a Triton GEMM's registers, the activations not
  quantized: no extra pass over them, a little less error).
- "int4": weight-only, 4-bit codes packed eight to an int32 along K (AWQ's packing) with a scale
  and an offset (the group's min) per 128 columns, w = q * scale + min (asymmetric, round to
  nearest); kernels.quant.int4_linear dequantizes tiles in registers at decode row counts, and
  the whole weight once into a temporary for a prefill's many rows. A quarter of the bytes (plus
  a sixteenth for the scales and offsets in bf16).
The embedding, norms and LM head stay in the model dtype (the LM head is the one GEMM whose error
lands directly in the sampled distribution).

`linear(x, w, bias)` is the one matmul the decoder calls for these weights: a plain tensor goes to
F.linear, a `QuantWeight` to its mode's kernel. `quantize_weights` replaces the matrices of a
decoder.Weights; `requantize_` rewrites them in place from new training weights (same buffers,
so captured CUDA graphs stay valid).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from hybridflow.config_checks import QUANTIZATION
from hybridflow.kernels.quant import (FP8_MAX, GROUP, KERNEL_MAX_ROWS, fp8_weight_only_linear,
                                      int4_linear, quant_rows_fp8)

MODES = QUANTIZATION  # rollout.quantization
MATRICES = ("qkv_w", "proj", "fc1", "fc2")  # the decoder.Layer fields quantized


@dataclass
class QuantWeight:
    """A quantized (N, K) weight: `codes` fp8 (N, K) or int32 (N, K / 8); `scales` fp32 (1, N)
    (fp8) or model dtype (N, K / GROUP) (int4); `mins` (N, K / GROUP) for int4."""
    mode: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    dtype: torch.dtype  # the activations' and the output's

    @property
    def shape(self) -> tuple:
        n, k = self.codes.shape
        return (n, k * 8) if self.mode == "int4" else (n, k)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight these codes stand for, in the model dtype (tests, references)."""
        if self.mode == "fp8":
            return (self.codes.float() * self.scales.t()).to(self.dtype)
        from hybridflow.kernels.quant import dequantize_int4

        return dequantize_int4(self.codes, self.scales, self.mins).to(self.dtype)


def check_shape(mode: str, name: str, shape: tuple) -> None:
    """Raise ValueError when `mode` cannot quantize an (N, K) weight (this TP shard's)."""
    n, k = shape
    if mode == "fp8" and (n % 16 or k % 16):
        raise ValueError(f"rollout.quantization=fp8: {name} shard is {n} x {k}; torch._scaled_mm "
                         f"needs both dimensions multiples of 16")
    if mode == "int4" and k % GROUP:
        raise ValueError(f"rollout.quantization=int4: {name} shard has {k} input columns, not a "
                         f"multiple of the group size {GROUP}")


def quantize(w: torch.Tensor, mode: str) -> QuantWeight:
    """w (N, K) -> its QuantWeight (fp32 math; round to nearest)."""
    n, k = w.shape
    if mode == "fp8":
        scales = torch.empty((1, n), dtype=torch.float32, device=w.device)
        codes = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
        q = QuantWeight("fp8", codes, scales, None, w.dtype)
    elif mode == "int4":
        codes = torch.empty((n, k // 8), dtype=torch.int32, device=w.device)
        scales = torch.empty((n, k // GROUP), dtype=w.dtype, device=w.device)
        q = QuantWeight("int4", codes, scales, torch.empty_like(scales), w.dtype)
    else:
        raise ValueError(f"rollout.quantization={mode!r}: expected one of {', '.join(MODES)}")
    return requantize_(q, w)


def requantize_(q: QuantWeight, w: torch.Tensor) -> QuantWeight:
    """Write w's quantization into q's buffers (in place) and return q."""
    n, k = w.shape
    if q.mode == "fp8":
        wf = w.float()
        scale = (wf.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # (N, 1)
        q.codes.copy_((wf / scale).clamp(-FP8_MAX, FP8_MAX))
        q.scales.copy_(scale.t())
        return q
    wg = w.float().view(n, k // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)  # (N, K / GROUP)
    # the scale rounded up and the offset rounded in the stored dtype first, so the codes are
    # those of the stored scale and offset: |w - dequantized| <= scale / 2 + |rounding of min|
    scale = ((hi - lo) / 15 * (1 + 2 ** -7)).clamp(min=1e-8).to(q.dtype).float()
    lo = lo.to(q.dtype).float()
    codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    codes = codes.view(n, k // 8, 8) << torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    q.codes.copy_(codes.sum(-1, dtype=torch.int32))  # disjoint nibbles: the sum is the OR
    q.scales.copy_(scale)
    q.mins.copy_(lo)
    return q


def linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None, *,
           residual: Optional[torch.Tensor] = None, pdl: bool = False, impl: str = "auto",
           fp8_weight_only_max_rows: int = 0,
           int4_kernel_max_rows: int = KERNEL_MAX_ROWS) -> torch.Tensor:
    """x (..., K) @ w^T (+ bias) -> (..., N) in x's dtype; w a tensor or a QuantWeight. With
    `residual` (x 2-D) the product is added into it in place and it is returned. `impl` picks the
    kernels or their twins (kernels._dispatch); fp8 GEMMs of at most `fp8_weight_only_max_rows`
    rows run weight-only (kernels.quant.fp8_weight_only_linear: no activation quantization);
    int4 GEMMs of more than `int4_kernel_max_rows` rows dequantize the weight once
    (kernels.quant.int4_linear)."""
    if not isinstance(w, QuantWeight):
        if residual is not None:
            if bias is None:
                return residual.addmm_(x, w.t())
            return residual.add_(F.linear(x, w, bias))
        return F.linear(x, w, bias)
    lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
    kw = dict(bias=bias, residual=residual, pdl=pdl, impl=impl)
    if w.mode == "int4":
        out = int4_linear(x2, w.codes, w.scales, w.mins, kernel_max_rows=int4_kernel_max_rows,
                          **kw)
    elif x2.shape[0] <= fp8_weight_only_max_rows and x2.shape[1] % GROUP == 0:
        out = fp8_weight_only_linear(x2, w.codes, w.scales, **kw)
    else:
        codes, scale = quant_rows_fp8(x2, pdl=pdl, impl=impl)
        out = torch._scaled_mm(codes, w.codes.t(), scale_a=scale, scale_b=w.scales,
                               out_dtype=x.dtype)  # (its bias argument: not with row-wise scales
        out = out if bias is None else out.add_(bias)  # in every CUDA build)
        if residual is not None:
            return residual.add_(out)
    return out if residual is not None else out.view(*lead, out.shape[-1])


def _matrices(layer) -> list:
    """The layer's quantizable fields (an MoE layer's fc1 / fc2 are None: its experts, in
    rollout/moe.py, stay unquantized)."""
    return [f for f in MATRICES if getattr(layer, f) is not None]


# decoder.Layer matrix field -> its Megatron linear in the layer
MATRIX_LINEARS = {"qkv_w": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
                  "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}


def quantize_weights(w, mode: str, fetch=None):
    """decoder.Weights `w` with every layer's matrices quantized (`mode` "none": w itself).
    `fetch(layer index, field, tensor) -> the (N, K) device tensor to quantize`: called for one
    matrix at a time, its result dropped after (matrices kept on the host and brought over one by
    one, so only one is on the device beside the codes)."""
    if mode == "none":
        return w
    for i, layer in enumerate(w.layers):
        for f in _matrices(layer):
            check_shape(mode, f"decoder.layers.{i}.{f}", tuple(getattr(layer, f).shape))
    get = fetch or (lambda i, f, t: t)
    layers = [dataclasses.replace(layer, **{f: quantize(get(i, f, getattr(layer, f)), mode)
                                            for f in _matrices(layer)})
              for i, layer in enumerate(w.layers)]
    return dataclasses.replace(w, layers=layers)


def requantize_weights_(q, w) -> None:
    """Rewrite the QuantWeights of decoder.Weights `q` from the plain weights `w` (in place)."""
    for lq, lw in zip(q.layers, w.layers):
        for f in _matrices(lq):
            requantize_(getattr(lq, f), getattr(lw, f))


def quantized_bytes(w) -> int:
    """Bytes held by the QuantWeights of decoder.Weights `w` (0 when none)."""
    return sum(getattr(layer, f).nbytes for layer in w.layers for f in _matrices(layer)
               if isinstance(getattr(layer, f), QuantWeight))
