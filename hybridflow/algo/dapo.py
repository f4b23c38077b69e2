"""DAPO's data-side pieces (Yu et al. 2025, arXiv 2503.14476) as pure tensor functions.

- Dynamic sampling keeps only *informative* groups: the samples of one prompt whose scores are
  not all equal. A group that is all right or all wrong has zero group-relative advantage, so it
  adds no policy gradient, only tokens to the normaliser. `informative_groups` is the filter; the
  loop that generates until enough groups pass lives in hybridflow/rollout/dynamic_sampling.py.
- Overlong reward shaping: a soft penalty over the last `buffer_len` tokens before the maximum
  response length L_max (verl's `overlong_buffer`):
      penalty(L) = min(0, -(L - (L_max - buffer_len)) / buffer_len * penalty_factor)
  0 up to L_max - buffer_len, then linear down to -penalty_factor at L_max.
"""

import torch
from torch import Tensor


def informative_groups(scores: Tensor, group_ids: Tensor) -> Tensor:
    """(B,) bool: True on the rows whose group (equal ids) has at least two different scores.

    scores (B,) float, group_ids (B,) int. A group of one sample is never informative.
    """
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores and group_ids must both be (B,); got {tuple(scores.shape)} and "
                         f"{tuple(group_ids.shape)}")
    _, inv = torch.unique(group_ids, return_inverse=True)  # (B,) group index per row
    num_groups = int(inv.max()) + 1 if inv.numel() else 0
    s = scores.double()
    hi = torch.full((num_groups,), -torch.inf, dtype=s.dtype).scatter_reduce(0, inv, s, "amax")
    lo = torch.full((num_groups,), torch.inf, dtype=s.dtype).scatter_reduce(0, inv, s, "amin")
    return (hi > lo)[inv]


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer_len: int,
                     penalty_factor: float) -> Tensor:
    """(B,) float32 penalty (<= 0) for response lengths (B,) (see module doc)."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer length must be in (0, max_len={max_len}], got {buffer_len}")
    exceed = lengths.float() - (max_len - buffer_len)
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)
