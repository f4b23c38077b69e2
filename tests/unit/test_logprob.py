"""vocab_parallel_logprobs on one rank: the torch path against torch.log_softmax, and the triton
path (the PyTorch twin of the Triton kernels on CPU) against the torch path, forward and backward,
with a padded vocabulary, a temperature and a strided (sliced) logits view."""

import pytest
import torch

from hybridflow.models.logprob import vocab_parallel_logprobs

B, T, V_TRUE, V_PAD = 3, 5, 37, 40


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = 3 * torch.randn(B, T + 2, V_PAD, generator=g, dtype=dtype)
    targets = torch.randint(0, V_TRUE, (B, T), generator=g)
    w_lp, w_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    return full, targets, w_lp, w_ent


def _expected(logits, targets, temperature):
    logp = torch.log_softmax(logits[..., :V_TRUE].double() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _run(impl, full, targets, w_lp, w_ent, temperature, with_entropy=True):
    full = full.detach().clone().requires_grad_()
    logits = full[:, 1:-1]  # (B, T, V_PAD) strided view, as the engine slices the response
    out = vocab_parallel_logprobs(logits, targets, tp_group=None, true_vocab_size=V_TRUE,
                                  temperature=temperature, with_entropy=with_entropy, impl=impl)
    lp, ent = out if with_entropy else (out, None)
    loss = (w_lp * lp).sum() + ((w_ent * ent).sum() if with_entropy else 0)
    loss.backward()
    return lp, ent, full.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_matches_log_softmax(temperature):
    full, targets, w_lp, w_ent = _inputs()
    lp, ent, grad = _run("torch", full, targets, w_lp, w_ent, temperature)
    x = full.detach().clone().requires_grad_()
    e_lp, e_ent = _expected(x[:, 1:-1], targets, temperature)
    ((w_lp * e_lp).sum() + (w_ent * e_ent).sum()).backward()
    torch.testing.assert_close(lp.double(), e_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), e_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), x.grad, rtol=1e-5, atol=1e-5)
    assert grad[..., V_TRUE:].abs().max() == 0  # padded ids get no gradient


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_matches_reference(temperature, with_entropy):
    full, targets, w_lp, w_ent = _inputs(torch.float32, seed=1)
    ref = _run("torch", full, targets, w_lp, w_ent, temperature, with_entropy)
    fused = _run("triton", full, targets, w_lp, w_ent, temperature, with_entropy)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[2], ref[2], rtol=1e-5, atol=1e-5)
    assert fused[2][:, [0, -1]].abs().max() == 0  # rows outside the slice untouched


def test_fused_bf16_logits_close_to_fp32():
    full, targets, w_lp, w_ent = _inputs(torch.float32, seed=2)
    ref = _run("torch", full, targets, w_lp, w_ent, 1.0)
    fused = _run("triton", full.bfloat16(), targets, w_lp, w_ent, 1.0)
    assert fused[2].dtype == torch.bfloat16  # the gradient stays in the logits' dtype
    torch.testing.assert_close(fused[0], ref[0], rtol=0, atol=0.1)
    torch.testing.assert_close(fused[2].float(), ref[2], rtol=0, atol=0.02)


def test_bad_impl_names_the_argument():
    full, targets, _, _ = _inputs()
    with pytest.raises(ValueError, match="impl"):
        vocab_parallel_logprobs(full[:, 1:-1], targets, tp_group=None, true_vocab_size=V_TRUE,
                                impl="cuda")
