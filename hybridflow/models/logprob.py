"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous vocab slice [start, start + V/TP). With z = logits - max:
  log p(t)  = z_t - log sum_v exp(z_v)
  entropy   = log sum exp(z) - sum_v p_v z_v
Padded vocabulary ids (>= true vocab size, added so the vocab divides TP) are excluded.
Logits are divided by the sampling temperature first, so these are log-probs of the distribution the
rollout sampled from (as verl does).

Two implementations of the same math (`impl`, the vocabulary of every kernel switch here:
auto | triton | torch):
- `triton` (auto's choice on CUDA when Triton imports): `kernels/logprob_entropy.py` reads each
  shard's logits once in their own dtype and returns per-row max / sum-exp / target logit
  (/ sum p x); one MAX and one SUM all-reduce over TP combine them; the backward kernel writes
  d/dlogits straight in the logits' dtype. No fp32 copy of the (B, T, V) logits is made (the torch
  path's fp32 passes over a 150k-id vocabulary are what made it slow). On CPU tensors the same
  autograd function runs the kernels' PyTorch twins.
- `torch` (auto's choice on CPU): plain autograd ops. The max is all-reduced (MAX, no grad); sums
  and the target logit with Megatron's `reduce_from_tensor_model_parallel_region` (forward
  all-reduce, backward identity): every TP rank computes the same loss from the reduced values, so
  the gradient of its own shard is exact. The triton path relies on the same fact: its backward
  needs no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from hybridflow.kernels import logprob_entropy as _k  # the repo's kernels/, shipped as hybridflow.kernels

_NEG = -1e4  # exp(-1e4) == 0 and 0 * -1e4 == 0: padded ids vanish without NaNs
IMPLS = ("auto", "triton", "torch")


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, tp_group,
                            true_vocab_size: int, temperature: float = 1.0,
                            with_entropy: bool = False, impl: str = "auto"):
    """logits (B, T, V/TP) this rank's vocab slice; targets (B, T) global ids (< true_vocab_size).

    Returns logprobs (B, T) float32 and, with `with_entropy`, entropy (B, T).
    impl: auto (triton on CUDA with Triton, else torch) | triton (the kernels: Triton on CUDA,
    their PyTorch twins elsewhere) | torch (plain autograd ops)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        impl = "triton" if logits.is_cuda and _k.HAVE_TRITON else "torch"
    if impl == "torch":
        return _reference(logits, targets, tp_group=tp_group, true_vocab_size=true_vocab_size,
                          temperature=temperature, with_entropy=with_entropy)
    inv_temp = 1.0 / temperature if temperature not in (0.0, 1.0) else 1.0
    logprobs, entropy = _FusedLogprobs.apply(logits, targets, tp_group, true_vocab_size,
                                             inv_temp, with_entropy)
    return (logprobs, entropy) if with_entropy else logprobs


def _tp(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _shard(tp_group, v_local: int, true_vocab_size: int) -> tuple[int, int]:
    """(start, v_valid) of this rank's vocab slice: its first global id and its real ids."""
    start = _tp(tp_group)[1] * v_local
    return start, max(0, min(v_local, true_vocab_size - start))


def _combine(m, s, t, xt, tp_group):
    """Per-shard max / sum-exp / sum p x / target logit -> (lse, E_p[x], target logit) over the
    whole vocabulary: one MAX and one SUM all-reduce over TP."""
    if _tp(tp_group)[0] > 1:
        m_all = m.clone()
        dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=tp_group)
        scale = (m - m_all).exp()
        sums = torch.stack([s * scale, t * scale, xt])  # (3, ...)
        dist.all_reduce(sums, group=tp_group)
        s, t, xt = sums.unbind(0)
        m = m_all
    return m + s.log(), t / s, xt


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp_group, true_vocab_size, inv_temp, with_entropy):
        start, v_valid = _shard(tp_group, logits.shape[-1], true_vocab_size)
        stats = _k.logprob_stats(logits, targets, start=start, v_valid=v_valid, inv_temp=inv_temp,
                                 with_entropy=with_entropy)  # (B, T) x4
        lse, ex, xt = _combine(*stats, tp_group)  # ex: E_p[x]
        ctx.save_for_backward(logits, targets, lse, ex)
        ctx.args = dict(start=start, v_valid=v_valid, inv_temp=inv_temp)
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        return xt - lse, lse - ex

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, ex = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 6
        grad = _k.logprob_grad(logits, targets, lse, ex, grad_logprobs, grad_entropy, **ctx.args)
        return grad, None, None, None, None, None


def _reference(logits, targets, *, tp_group, true_vocab_size, temperature, with_entropy):
    logits = logits.float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    tp_size, tp_rank = _tp(tp_group)
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


def chunked_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                            tp_group, true_vocab_size: int, temperature: float = 1.0,
                            with_entropy: bool = False, chunk_tokens: int,
                            bias: torch.Tensor | None = None, impl: str = "auto"):
    """The LM head and the log-prob pass together, `chunk_tokens` positions at a time
    (parallel.lm_head_chunk_tokens): logits (N, V/TP) are never held whole; each chunk's are made,
    reduced to their per-position statistics and dropped, and the backward makes them again (one
    more LM-head GEMM) to form d/dlogits, then d/dhidden and this shard's weight gradient (summed
    over chunks in fp32). verl's fused linear-for-PPO and Liger's fused linear cross-entropy do
    the same to the vocab-sized activations: at 16k response positions x 152k vocab they are 5 GB
    of bf16 logits kept for backward plus 5 GB of their gradient.

    hidden (N, H) the LM head's input (this rank's, after any TP/SP copy or gather); weight
    (V/TP, H) this shard; targets (N,) global ids. Returns logprobs (N,) float32 and, with
    `with_entropy`, entropy (N,): the values vocab_parallel_logprobs gives on the full logits."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: expected a positive number of positions")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    kernels = "torch" if impl == "torch" else "auto"
    inv_temp = 1.0 / temperature if temperature not in (0.0, 1.0) else 1.0
    logprobs, entropy = _ChunkedLinearLogprobs.apply(hidden, weight, bias, targets, tp_group,
                                                     true_vocab_size, inv_temp, with_entropy,
                                                     chunk_tokens, kernels)
    return (logprobs, entropy) if with_entropy else logprobs


class _ChunkedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, tp_group, true_vocab_size, inv_temp,
                with_entropy, chunk, kernels):
        start, v_valid = _shard(tp_group, weight.shape[0], true_vocab_size)
        args = dict(start=start, v_valid=v_valid, inv_temp=inv_temp, impl=kernels)
        stats = []
        for i in range(0, hidden.shape[0], chunk):
            logits = torch.nn.functional.linear(hidden[i:i + chunk], weight, bias)  # (c, V/TP)
            stats.append(torch.stack(_k.logprob_stats(
                logits[None], targets[None, i:i + chunk], with_entropy=with_entropy,
                **args))[:, 0])  # (4, c)
            del logits
        stats = torch.cat(stats, 1) if stats else hidden.new_zeros(4, 0, dtype=torch.float32)
        lse, ex, xt = _combine(*stats, tp_group)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ex)
        ctx.args, ctx.chunk, ctx.with_entropy = args, chunk, with_entropy
        ctx.set_materialize_grads(False)
        return xt - lse, lse - ex

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, ex = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 10
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32,
                                                          device=bias.device)
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i:i + chunk]
            sl = slice(i, i + h.shape[0])
            logits = torch.nn.functional.linear(h, weight, bias)
            g = _k.logprob_grad(logits[None], targets[None, sl], lse[None, sl], ex[None, sl],
                                None if grad_logprobs is None else grad_logprobs[None, sl],
                                None if grad_entropy is None else grad_entropy[None, sl],
                                **ctx.args)[0]  # (c, V/TP) in the logits' dtype
            del logits
            torch.matmul(g, weight, out=grad_hidden[sl])
            grad_weight.add_(g.t() @ h)
            if grad_bias is not None:
                grad_bias.add_(g.sum(0, dtype=torch.float32))
        # autograd casts the fp32 sums to the parameters' dtype once
        return grad_hidden, grad_weight, grad_bias, *(None,) * 7
