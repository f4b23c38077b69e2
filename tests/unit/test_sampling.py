"""Sampler: greedy, and that temperature / top-k / top-p draws follow the target distribution.

The statistical checks draw many samples with a fixed seed over a small vocabulary and compare the
counts with the analytically filtered distribution: zero counts off the support, a chi-square test
(critical value at p = 1e-4 via Wilson-Hilferty) and a total-variation bound.
"""

import math

import pytest
import torch

from hybridflow.rollout.sampling import sample

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.7, 0.1, -0.3, -1.0, -2.5])
DRAWS = 40000


def _target(logits, *, temperature, top_k=0, top_p=1.0):
    """Reference: probs of softmax(l / T), keep top-k, then the nucleus (mass before < p)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True).tolist()
    keep = order[:top_k] if top_k else order
    kept_p = p[keep] / p[keep].sum()
    nucleus, mass = [], 0.0
    for i, q in zip(keep, kept_p.tolist()):
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += q
    out = torch.zeros_like(p)
    out[nucleus] = p[nucleus] / p[nucleus].sum()
    return out


def _chi2_critical(df: int, z: float = 3.719) -> float:  # z: upper 1e-4 normal quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.8), (1.0, 0, 0.05)])
def test_draws_match_target_distribution(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1234)
    logits = LOGITS.expand(DRAWS, -1).clone()
    tok, _ = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    counts = torch.bincount(tok, minlength=len(LOGITS)).double()
    target = _target(LOGITS, temperature=temperature, top_k=top_k, top_p=top_p)
    support = target > 0
    assert counts[~support].sum() == 0, "a filtered token was sampled"
    expected = target[support] * DRAWS
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert chi2 < _chi2_critical(df), (chi2, df)
    tv = 0.5 * float((counts / DRAWS - target).abs().sum())
    assert tv < 0.01, tv


def test_greedy_is_argmax_and_logprobs_are_temperature_scaled():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    tok, lp = sample(logits, temperature=0.0, need_logprobs=True)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))
    tok, lp = sample(logits, temperature=0.5, top_k=3, generator=torch.Generator().manual_seed(0),
                     need_logprobs=True)
    ref = torch.log_softmax(logits / 0.5, -1).gather(1, tok[:, None]).squeeze(1)
    assert torch.allclose(lp, ref)  # before top-k filtering, like verl's old-log-prob pass
    assert sample(logits, temperature=1.0, generator=torch.Generator())[1] is None


def test_seeded_reproducibility_and_top1():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    a, _ = sample(logits, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    b, _ = sample(logits, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    c, _ = sample(logits, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    k1, _ = sample(logits, temperature=2.0, top_k=1, generator=torch.Generator())
    assert torch.equal(k1, logits.argmax(-1))


def test_bf16_logits_and_the_compiled_race_draw_what_fp32_eager_draws():
    """A decode step hands bf16 logits to the sampler (no fp32 copy): greedy and the race on them
    equal the fp32 ones of the same values, eager or through torch.compile (aot_eager here)."""
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = logits.float()
    assert torch.equal(sample(logits, temperature=0.0)[0], ref.argmax(-1))
    kw = dict(temperature=0.8, need_logprobs=True)
    tok, lp = sample(ref, generator=torch.Generator().manual_seed(9), **kw)
    for backend in (None, "aot_eager"):
        t, p = sample(logits, generator=torch.Generator().manual_seed(9), compile_backend=backend,
                      **kw)
        assert torch.equal(t, tok)
        torch.testing.assert_close(p, lp)
    torch.testing.assert_close(lp, torch.log_softmax(ref / 0.8, -1).gather(1, tok[:, None])[:, 0])
