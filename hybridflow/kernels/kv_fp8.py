"""The fp8 KV cache format (rollout.kv_cache_dtype=fp8; the cache itself: rollout/kv_cache.py).

One side (K or V) is an `Fp8KV`: E4M3 codes (..., T, hd) plus one fp32 scale per (..., T), value =
code * scale, the scale amax x fp32(1 / 448) of the head_dim values it covers (a per-token,
per-KV-head scale: no calibration, no value clipped; 1 + 4 / head_dim bytes per value against
bf16's 2). An Fp8KV slices like the tensor it stands for over every dimension but head_dim, so the decoder's
views (`KVCache.layer`, `[:, :, :kv_len]`) read alike. The writes quantize (`write_columns`,
`layer_ops.write_column`, kernels/rope_attention.py's kernel, bit for bit as `quantize_kv`); the
PyTorch readers dequantize to the compute dtype (`readable`); the Triton decode attention reads the
codes and scales itself (layer_ops._attend_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import FP8_MAX  # E4M3's largest finite value

KV_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8KV:
    """One side (K or V) of an fp8 cache, or a view of one: codes (..., T, hd) float8_e4m3fn and
    scale (..., T) fp32."""
    codes: torch.Tensor
    scale: torch.Tensor

    def __getitem__(self, index) -> "Fp8KV":
        """The same view of codes and scale; `index` may not reach head_dim."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) >= self.codes.dim() or Ellipsis in index:
            raise IndexError(f"Fp8KV views index the leading {self.codes.dim() - 1} dimensions "
                             f"only, got {index!r}")
        return Fp8KV(self.codes[index], self.scale[index])

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def tensors(self) -> tuple:
        return self.codes, self.scale


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hd) -> (codes (..., hd) float8_e4m3fn, scale (...,) fp32): scale = amax x fp32(1 /
    448) over the last dimension (1 where it is all zero; a product, as every device rounds it
    alike: CUDA's division by a scalar is itself a product with its reciprocal), codes = x / scale
    rounded to nearest even. The Triton decode kernel (kernels/rope_attention.py) computes the
    same bits."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    codes = (xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(KV_FP8)
    return codes, scale


def dequantize_kv(part: Fp8KV, dtype: torch.dtype) -> torch.Tensor:
    return (part.codes.float() * part.scale[..., None]).to(dtype)


def readable(part, dtype: torch.dtype) -> torch.Tensor:
    """A cache view as a tensor PyTorch's attention reads: itself, or an Fp8KV dequantized."""
    return dequantize_kv(part, dtype) if isinstance(part, Fp8KV) else part


def write_columns(part, x: torch.Tensor, start: int = 0) -> None:
    """part (B, G, T, hd)[:, :, start:start + S] = x (B, G, S, hd) (quantized for an Fp8KV)."""
    stop = start + x.shape[2]
    if isinstance(part, Fp8KV):
        codes, scale = quantize_kv(x)
        part.codes[:, :, start:stop].copy_(codes)
        part.scale[:, :, start:stop].copy_(scale)
    else:
        part[:, :, start:stop].copy_(x)


def as_indexable(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes as uint8 (the same bits): index_copy / scatter have no float8 kernels on CPU."""
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t
