"""Token sampling from full-vocabulary logits: greedy, temperature, top-k, top-p.

`sample(logits, ...)` takes logits (B, V) that hold only the TRUE vocabulary (the decoder drops the
padded ids before calling it, so padded ids can never be drawn) and returns one token per row.

Choices:
- temperature == 0 means greedy (argmax; the first maximal id on ties).
- top-k keeps the k largest logits (`torch.topk`, sorted); top-p then keeps the smallest prefix of
  the sorted tokens whose mass reaches p (a token is dropped when the mass BEFORE it is >= p; the
  top token always stays). Without top-k, top-p sorts the whole vocabulary.
- The draw is the exponential race (Gumbel-max): argmax(p_i / E_i) with E_i ~ Exp(1) from a
  seeded `torch.Generator`. Without top-k/top-p that is argmax(z_i / T - log E_i) (log p_i differs
  from z_i / T by a constant of the row), computed without the softmax; with `compile_backend` (a
  decode step under rollout.compile_decode) the scaling, the log and the argmax are one fused
  reduction over the logits (bf16 from a decode step: read once, never copied to fp32), as is the
  log-prob of the drawn token. Greedy takes the argmax in the logits' own dtype (with
  kernels="triton" on a GPU as kernels/next_token.argmax_rows: two passes over vocabulary chunks,
  the same ids as torch.argmax). Every op has a
  static shape and there is no host sync, so the sampler runs inside a captured CUDA graph (the
  generator is registered with the graph).
- With a device stream `rng_state` (rollout.kernel_options.fused_sampler) and kernels="triton",
  the temperature draw without top-k/top-p and its log-prob are kernels/sample.sample_rows: not
  the race but the inverse CDF in two Triton passes (each vocabulary chunk's mass, then one
  uniform per row from a Philox counter in `rng_state`, advanced in place, not `generator`'s
  stream, and a scan of the chunk that holds it), through the Triton interpreter on CPU under
  TRITON_INTERPRET=1; other settings take the paths above.
- Log-probs (when asked) are those of the sampled token under the temperature-scaled distribution
  BEFORE top-k/top-p filtering: log_softmax(logits / T) (T = 1 for greedy). That is what verl's
  old-log-prob pass recomputes (it divides the logits by the rollout temperature), so the two can be
  compared directly; they are informational, the trainer recomputes its own.
"""

from __future__ import annotations

import functools
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


def draw(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One index per row of `probs` (B, K) (unnormalised is fine; 0: never) by the exponential
    race argmax(p / E)."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    # a 0 draw (possible at fp32 resolution) must not turn 0/0 into NaN for zero entries
    return torch.argmax(probs / race.clamp_min_(torch.finfo(race.dtype).tiny), dim=-1)


def _race_argmax(logits, race, inv_temp: float):
    """argmax(z / T - log E) per row: the exponential race without the softmax."""
    tiny = torch.finfo(torch.float32).tiny  # a 0 draw (fp32 resolution): finite, the row's winner
    return torch.argmax(logits.float() * inv_temp - race.clamp_min(tiny).log(), dim=-1)


def _token_logprobs(logits, tokens, inv_temp: float):
    """log_softmax(z / T) at `tokens`, per row."""
    scaled = logits.float() * inv_temp
    return scaled.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)


@functools.cache
def _compiled(backend: str):
    return (torch.compile(_race_argmax, dynamic=True, backend=backend),
            torch.compile(_token_logprobs, dynamic=True, backend=backend))


def fused_draw_applies(*, kernels: str, temperature: float, top_k: int, top_p: float) -> bool:
    """Whether `sample` draws by kernels/sample.sample_rows (given a device stream): the Triton
    kernels, temperature > 0, no top-k / top-p."""
    return kernels == "triton" and temperature > 0.0 and top_k == 0 and top_p >= 1.0


def sample(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None, need_logprobs: bool = False,
           compile_backend: Optional[str] = None, kernels: str = "torch", pdl: bool = False,
           replace: Optional[tuple] = None, rng_state: Optional[torch.Tensor] = None):
    """logits (B, V) over the true vocabulary, any float dtype -> (tokens (B,) int64, logprobs (B,)
    fp32 or None). `compile_backend`: run the race and the log-probs through torch.compile.
    `replace` (where (B,) bool, tokens (B,) int64): those rows emit the given token in place of
    the draw (replays, tests; the draw still consumes the stream), their log-probs the given
    token's.
    `kernels` (a resolved rollout.decode_kernels): "triton" takes greedy's argmax by the Triton
    kernel for CUDA logits (launched with `pdl`), "torch" by torch.argmax.
    `rng_state` ((2,) int64 [key, counter], kernels/sample.py): with kernels "triton", temperature
    > 0, top_k 0 and top_p 1 the draw and its log-prob are kernels/sample.sample_rows's (the
    inverse CDF from its stream, not `generator`'s); None: the PyTorch sampler always."""
    if rng_state is not None and fused_draw_applies(kernels=kernels, temperature=temperature,
                                                    top_k=top_k, top_p=top_p):
        from hybridflow.kernels._dispatch import interpreting
        from hybridflow.kernels.sample import sample_rows

        return sample_rows(logits, 1.0 / temperature, rng_state, replace=replace,
                           need_logprobs=need_logprobs, pdl=pdl,
                           # (CPU tests run the kernel too)
                           impl="triton" if logits.is_cuda or interpreting() else "torch")
    race_argmax, token_logprobs = (_compiled(compile_backend) if compile_backend else
                                   (_race_argmax, _token_logprobs))
    inv_temp = 1.0 if temperature == 0.0 else 1.0 / temperature
    if temperature == 0.0 and kernels == "triton" and logits.is_cuda:
        from hybridflow.kernels.next_token import argmax_rows

        tokens = argmax_rows(logits, pdl=pdl, impl="triton")
    elif temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)  # (B,); an fp32 copy would change no order
    elif top_k == 0 and top_p >= 1.0:
        race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        tokens = race_argmax(logits, race.exponential_(generator=generator), inv_temp)
    else:
        values, ids = filter_logits(logits.float() * inv_temp, top_k=top_k, top_p=top_p)
        probs = torch.softmax(values, dim=-1)  # (B, K); 0 where filtered
        choice = draw(probs, generator)
        tokens = choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)
    if replace is not None:
        tokens = torch.where(replace[0], replace[1], tokens)
    if not need_logprobs:
        return tokens, None
    return tokens, token_logprobs(logits, tokens, inv_temp)
