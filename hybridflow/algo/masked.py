"""Masked reductions over the valid tokens of a ragged batch.

A mask is 1 (or True) on the positions that count. Masked-out positions are excluded with
`torch.where`, not multiplied by 0, so a NaN or inf in padding cannot leak into a sum.
Counts of zero divide as if they were 1, so the mean of nothing is 0 (verl adds 1e-8 instead).
The variance is unbiased (Bessel's n/(n-1)) like verl's; with a single valid element it is 0
(verl raises there: one valid token is a legal, if degenerate, batch).
"""

from typing import Optional

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None, *, keepdim: bool = False) -> Tensor:
    """Sum of `x` where `mask` is set; over everything when `dim` is None (0-dim result)."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim, keepdim=keepdim)


def _count(x: Tensor, mask: Tensor, dim: Optional[int], keepdim: bool) -> Tensor:
    m = mask.bool().expand_as(x)
    n = m.sum() if dim is None else m.sum(dim=dim, keepdim=keepdim)
    return n.to(x.dtype)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None, *, keepdim: bool = False) -> Tensor:
    """Mean of `x` over the masked positions (along `dim`, or over everything); 0 where none are valid."""
    return masked_sum(x, mask, dim, keepdim=keepdim) / _count(x, mask, dim, keepdim).clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, dim: Optional[int] = None, *, unbiased: bool = True) -> Tensor:
    """Variance over the masked positions: sum((x - mean)^2) / (n - 1) (unbiased) or / n."""
    keep = dim is not None  # keep the reduced dim so the mean broadcasts back over x
    mean = masked_mean(x, mask, dim, keepdim=keep)
    sq = masked_sum((x - mean) ** 2, mask, dim)
    n = _count(x, mask, dim, keepdim=False)
    return sq / ((n - 1) if unbiased else n).clamp_min(1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mean and unbiased var over all masked positions.

    With `shift_mean=False` the mean is added back (only the scale changes). Masked-out
    positions of the result are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))
