"""The Triton log-prob/entropy kernels against their PyTorch twin and the reference autograd path, on
CUDA: bf16 and fp32 logits, padded vocabulary, a temperature, a sliced (strided) logits view, a vocab
longer than several kernel blocks, and targets outside this shard (as under TP)."""

import pytest
import torch

from hybridflow.models.logprob import _k as k
from hybridflow.models.logprob import vocab_parallel_logprobs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not k.HAVE_TRITON:
    pytest.skip("needs triton", allow_module_level=True)

B, T, V_TRUE, V_PAD = 3, 37, 10_000, 10_112  # V_PAD > 2 kernel blocks; 112 padded ids


def _inputs(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    full = (4 * torch.randn(B, T + 1, V_PAD, device="cuda", generator=g)).to(dtype)
    targets = torch.randint(0, V_TRUE, (B, T), device="cuda", generator=g)
    w = torch.randn(2, B, T, device="cuda", generator=g)
    return full, targets, w


def _run(impl, full, targets, w, temperature):
    full = full.detach().clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(full[:, :-1], targets, tp_group=None, true_vocab_size=V_TRUE,
                                      temperature=temperature, with_entropy=True, impl=impl)
    ((w[0] * lp).sum() + (w[1] * ent).sum()).backward()
    return lp, ent, full.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_matches_reference(dtype, temperature):
    full, targets, w = _inputs(dtype)
    lp, ent, grad = _run("triton", full, targets, w, temperature)
    r_lp, r_ent, r_grad = _run("torch", full, targets, w, temperature)
    assert grad.dtype == dtype
    torch.testing.assert_close(lp, r_lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, r_ent, rtol=1e-4, atol=1e-4)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 gradient rounding vs fp32
    torch.testing.assert_close(grad.float(), r_grad.float(), rtol=tol, atol=tol)
    assert grad[..., V_TRUE:].abs().max() == 0 and grad[:, -1].abs().max() == 0


@pytest.mark.parametrize("start", [0, 3_000, 20_000])  # shard holding all / part of / none of targets
def test_kernels_match_torch_twin(start):
    full, targets, w = _inputs(torch.bfloat16, seed=1)
    logits, v_valid = full[:, 1:], min(V_PAD, max(0, V_TRUE + 3_000 - start))
    args = dict(start=start, v_valid=v_valid, inv_temp=1.25)
    got = k.logprob_stats(logits, targets, with_entropy=True, impl="triton", **args)
    ref = k.logprob_stats(logits, targets, with_entropy=True, impl="torch", **args)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    lse = torch.full((B, T), 12.0, device="cuda")  # a global lse (other shards) keeps p finite
    ex = torch.full((B, T), 0.5, device="cuda")
    g = k.logprob_grad(logits, targets, lse, ex, w[0], w[1], impl="triton", **args)
    r = k.logprob_grad(logits, targets, lse, ex, w[0], w[1], impl="torch", **args)
    torch.testing.assert_close(g.float(), r.float(), rtol=1e-2, atol=1e-3)


def test_large_vocab_cross_entropy():
    """The benchmark's use: -mean logprob over a 152k vocab equals F.cross_entropy."""
    v = 151_936
    logits = torch.randn(2, 256, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 151_655, (2, 256), device="cuda")
    loss = -vocab_parallel_logprobs(logits, targets, tp_group=None, true_vocab_size=151_655).mean()
    loss.backward()
    x = logits.detach().float()[..., :151_655].requires_grad_()
    ref = torch.nn.functional.cross_entropy(x.flatten(0, 1), targets.flatten())
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    n = targets.numel()  # compare per-token gradients (mean divides by n)
    torch.testing.assert_close(logits.grad[..., :151_655].float() * n, x.grad * n, rtol=1e-2,
                               atol=1e-5)
    assert logits.grad[..., 151_655:].abs().max() == 0
