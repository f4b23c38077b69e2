"""parallel.mlp_kernels=quack on a GPU: the gated MLP on quack's fused GEMMs (models/quack_mlp.py)
against an fp32 reference (output, input gradient, both weight gradients, returned or added into
an fp32 main_grad), forward-only without the pre-activation, and the Engine's bf16 update with it
against the one with Megatron's MLP."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.models import quack_mlp

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
_WHY = quack_mlp.quack_unsupported(torch.device("cuda"))
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)

N, H, FF = 3000, 896, 1216  # ragged token count, Qwen2.5-0.5B width, a multiple of 16 for 2F


def _reference(x, w1, w2):
    x, w1, w2 = (t.detach().float().requires_grad_(True) for t in (x, w1, w2))
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    out = F.linear(F.silu(gate) * up, w2)
    return out, (x, w1, w2)


def _inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(2 * FF, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(H, FF, device="cuda", generator=g) / FF ** 0.5).bfloat16()
    dout = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    return x, w1, w2, dout


def _close(got, want, what):
    err = (got.float() - want).norm() / want.norm()
    assert err < 1.5e-2, f"{what}: relative error {err:.3e}"


@pytest.mark.parametrize("main_grad", [False, True])
def test_gated_mlp_matches_fp32(main_grad):
    x, w1, w2, dout = _inputs()
    ref_out, (rx, rw1, rw2) = _reference(x, w1, w2)
    ref_out.backward(dout.float())
    x, w1, w2 = (t.clone().requires_grad_(True) for t in (x, w1, w2))
    if main_grad:
        for w in (w1, w2):
            w.main_grad = torch.ones(w.shape, device="cuda")
    out = quack_mlp._GatedMLP.apply(x, w1, w2, main_grad)
    out.backward(dout)
    _close(out, ref_out, "out")
    _close(x.grad, rx.grad, "dx")
    if main_grad:  # added into the fp32 buffers, none handed to autograd
        assert w1.grad is None and w2.grad is None
        _close(w1.main_grad - 1, rw1.grad, "dw1 (main_grad)")
        _close(w2.main_grad - 1, rw2.grad, "dw2 (main_grad)")
    else:
        _close(w1.grad, rw1.grad, "dw1")
        _close(w2.grad, rw2.grad, "dw2")


def test_forward_only_equals_training_forward():
    x, w1, w2, _ = _inputs(1)
    with torch.no_grad():
        a = quack_mlp._GatedMLP.apply(x, w1, w2, False)
    b = quack_mlp._GatedMLP.apply(x, w1.requires_grad_(True), w2, False)
    assert torch.equal(a, b.detach())


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def _engine_steps(ctx, kernels, monkeypatch):
    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig, OptimConfig, ParallelConfig
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic
    from tests.unit import test_wgrad_fusion as cpu

    calls = []
    real = quack_mlp._GatedMLP.apply
    monkeypatch.setattr(quack_mlp._GatedMLP, "apply",
                        staticmethod(lambda *a: (calls.append(1), real(*a))[1]))
    eng = Engine(role="actor", model_cfg=cpu.MODEL, ctx=ctx, precision="bf16",
                 parallel=ParallelConfig(mlp_kernels=kernels), optim=OptimConfig(lr=1e-3),
                 total_updates=2)
    fill_deterministic(eng.module, num_layers=cpu.MODEL.num_layers)
    eng.optimizer.reload_model_params()
    metrics = []
    for seed in (0, 1):
        loss_fn = actor_objective(AlgoConfig(), num_tokens=cpu.B * cpu.R, num_seqs=cpu.B)
        metrics.append(eng.train_step(cpu._batch(seed), loss_fn, micro_batch_size=cpu.MICRO))
    weights = {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}
    return metrics, weights, len(calls)


def test_engine_update_matches_megatron_mlp(ctx, monkeypatch):
    m_ref, w_ref, n_ref = _engine_steps(ctx, "torch", monkeypatch)
    m, w, n = _engine_steps(ctx, "quack", monkeypatch)
    from tests.unit import test_wgrad_fusion as cpu

    assert n_ref == 0 and n == cpu.MODEL.num_layers * 2 * 2  # layers x micro-batches x steps
    tol = dict(rtol=2e-2, atol=2.5e-3)
    for a, b in zip(m, m_ref):
        for key in b:
            torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), **tol)
    for name in w_ref:
        torch.testing.assert_close(w[name], w_ref[name], **tol, msg=name)
