"""Token sampling from full-vocabulary logits: greedy, temperature, top-k, top-p.

`sample(logits, ...)` takes logits (B, V) that hold only the TRUE vocabulary (the decoder drops the
padded ids before calling it, so padded ids can never be drawn) and returns one token per row.

Choices:
- temperature == 0 means greedy (argmax; the first maximal id on ties).
- top-k keeps the k largest logits (`torch.topk`, sorted); top-p then keeps the smallest prefix of
  the sorted tokens whose mass reaches p (a token is dropped when the mass BEFORE it is >= p; the
  top token always stays). Without top-k, top-p sorts the whole vocabulary.
- The draw is the exponential race (equivalent to Gumbel-max): argmax(p_i / E_i) with E_i ~ Exp(1)
  from a seeded `torch.Generator`. Every op has a static shape and there is no host sync, so the
  sampler runs inside a captured CUDA graph (the generator is registered with the graph).
- Log-probs (when asked) are those of the sampled token under the temperature-scaled distribution
  BEFORE top-k/top-p filtering: log_softmax(logits / T) (T = 1 for greedy). That is what verl's
  old-log-prob pass recomputes (it divides the logits by the rollout temperature), so the two can be
  compared directly; they are informational, the trainer recomputes its own.
"""

from __future__ import annotations

from typing import Optional

import torch


def filter_logits(scaled: torch.Tensor, *, top_k: int, top_p: float):
    """(values (B, K), ids (B, K) or None): candidate logits, sorted descending when filtered,
    with the ones outside top-k/top-p set to -inf. ids None means values index the vocab directly."""
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        values, ids = torch.topk(scaled, top_k, dim=-1)  # (B, k), sorted
    elif top_p < 1.0:
        values, ids = torch.sort(scaled, dim=-1, descending=True)  # (B, V)
    else:
        return scaled, None
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        values = values.masked_fill(mass_before >= top_p, float("-inf"))
    return values, ids


def sample(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None, need_logprobs: bool = False):
    """logits (B, V) over the true vocabulary -> (tokens (B,) int64, logprobs (B,) fp32 or None)."""
    logits = logits.float()
    if temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)  # (B,)
        scaled = logits
    else:
        scaled = logits / temperature
        values, ids = filter_logits(scaled, top_k=top_k, top_p=top_p)
        probs = torch.softmax(values, dim=-1)  # (B, K); 0 where filtered
        race = torch.empty_like(probs).exponential_(generator=generator)
        # a 0 draw (possible at fp32 resolution) must not turn 0/0 into NaN for filtered tokens
        choice = torch.argmax(probs / race.clamp_min_(torch.finfo(race.dtype).tiny), dim=-1)
        tokens = choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)
    if not need_logprobs:
        return tokens, None
    logprobs = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs
