"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous vocab slice [start, start + V/TP). With z = logits - max:
  log p(t)  = z_t - log sum_v exp(z_v)
  entropy   = log sum exp(z) - sum_v p_v z_v
The max is all-reduced (MAX, no grad); the sums and the target logit are all-reduced with Megatron's
`reduce_from_tensor_model_parallel_region` (forward all-reduce, backward identity): every TP rank
computes the same loss from the reduced values, so the gradient of its own shard is exact.
Padded vocabulary ids (>= true vocab size, added so the vocab divides TP) are excluded.
Logits are divided by the sampling temperature first, so these are log-probs of the distribution the
rollout sampled from (as verl does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

_NEG = -1e4  # exp(-1e4) == 0 and 0 * -1e4 == 0: padded ids vanish without NaNs


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, tp_group,
                            true_vocab_size: int, temperature: float = 1.0,
                            with_entropy: bool = False):
    """logits (B, T, V/TP) this rank's vocab slice; targets (B, T) global ids.

    Returns logprobs (B, T) float32 and, with `with_entropy`, entropy (B, T)."""
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    ids = torch.arange(start, start + v_local, device=logits.device)
    pad = ids >= true_vocab_size  # (V/TP,)

    with torch.no_grad():
        m = logits.masked_fill(pad, float("-inf")).amax(dim=-1)
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    z = (logits - m.unsqueeze(-1)).masked_fill(pad, _NEG)  # (B, T, V/TP)
    e = z.exp()
    sum_e = e.sum(-1)
    in_shard = (targets >= start) & (targets < start + v_local)
    z_t = z.gather(-1, (targets - start).clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    z_t = z_t * in_shard
    if tp_size > 1:
        sum_e = reduce_from_tensor_model_parallel_region(sum_e, group=tp_group)
        z_t = reduce_from_tensor_model_parallel_region(z_t, group=tp_group)
    lse = sum_e.log()
    logprobs = z_t - lse
    if not with_entropy:
        return logprobs
    ez = (e * z).sum(-1)
    if tp_size > 1:
        ez = reduce_from_tensor_model_parallel_region(ez, group=tp_group)
    entropy = lse - ez / sum_e
    return logprobs, entropy
