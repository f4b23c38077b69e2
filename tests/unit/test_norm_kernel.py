"""parallel.norm_kernel (hybridflow/models/fused.py rms_norm, models/build.py TorchRMSNorm): the
formula `compiled` compiles is torch's RMSNorm (forward and gradients, fp32 and bf16), the compiled
function itself on CPU, the model's norms take the configured kernel, CPU tensors stay on torch's,
and an unknown kernel is an error naming the key. The CUDA kernels:
tests/gpu/test_norm_kernel_gpu.py."""

import pytest
import torch

from hybridflow.config import ModelConfig
from hybridflow.models import fused


def _norm_and_grads(fn, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formula_is_torchs_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 24, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(24, generator=g)).to(dtype)
    dy = torch.randn(37, 24, generator=g).to(dtype)
    want = _norm_and_grads(lambda a, b: fused.rms_norm(a, b, 1e-6, "torch"), x, w, dy)
    got = _norm_and_grads(lambda a, b: fused._rms_norm_formula(a, b, 1e-6), x, w, dy)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, **tol)


def test_compiled_runs_the_formula():
    g = torch.Generator().manual_seed(1)
    for rows in (5, 9):  # dynamic shapes: a second row count is not the first's kernel
        x, w = torch.randn(rows, 16, generator=g), torch.randn(16, generator=g)
        dy = torch.randn(rows, 16, generator=g)
        want = _norm_and_grads(lambda a, b: fused._rms_norm_formula(a, b, 1e-5), x, w, dy)
        got = _norm_and_grads(lambda a, b: fused.rms_norm(a, b, 1e-5, "compiled"), x, w, dy)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_eps_none_is_the_dtypes_epsilon():
    x, w = torch.randn(4, 8), torch.ones(8)
    assert torch.equal(fused.rms_norm(x, w, None),
                       torch.nn.functional.rms_norm(x, (8,), w, torch.finfo(x.dtype).eps))


def test_unknown_kernel_names_the_key():
    with pytest.raises(ValueError, match="parallel.norm_kernel='apex'"):
        fused.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6, "apex")


def test_config_rejects_unknown_kernel():
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    cfg = load_config(["parallel.norm_kernel=apex"])
    with pytest.raises(ValueError, match="parallel.norm_kernel='apex' is not one of"):
        validate(cfg, world_size=1)


def test_model_norms_take_the_kernel_and_cpu_stays_torchs(single_rank_ctx, monkeypatch):
    from hybridflow.models import build

    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, vocab_size=64)
    model = build.build_model(cfg, role="actor", ctx=single_rank_ctx, norm_kernel="compiled")
    norms = [m for m in model.modules() if isinstance(m, build.TorchRMSNorm)]
    assert len(norms) == 2 * cfg.num_layers + 1  # two per layer and the final one
    assert all(m.kernel == "compiled" for m in norms)
    calls = []
    monkeypatch.setattr(build, "rms_norm", lambda *a: calls.append(a))
    ids = torch.randint(0, 64, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    plain = build.build_model(cfg, role="actor", ctx=single_rank_ctx)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(ids, pos, None), plain(ids, pos, None))
    assert not calls  # CPU tensors: torch's norm
