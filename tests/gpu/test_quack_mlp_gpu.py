"""parallel.mlp_kernels=quack on a GPU: the gated MLP on quack's fused GEMMs (models/quack_mlp.py)
against an fp32 reference (output, input gradient, both weight gradients, returned or added into
an fp32 main_grad), forward-only without the pre-activation, and the Engine's bf16 update with it
against the one with Megatron's MLP."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.models import quack_mlp
from tests.gpu.quack_util import require_quack

pytestmark = pytest.mark.gpu
require_quack()

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


# wide enough for quack's tiles to be exercised as in real models (the CPU tests' width-32 model
# is not), small enough to run in seconds
MODEL_Q = dict(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
               num_query_groups=2, vocab_size=50, add_qkv_bias=True, tie_word_embeddings=True)


def _engine_grads(ctx, precision, kernels, monkeypatch):
    """One Engine update on the CPU tests' batch: its metrics, the MLP weights' main_grad (the
    gradient DDP reduces, before the optimizer reads it) and how many MLPs ran on quack."""
    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic
    from tests.unit import test_wgrad_fusion as cpu

    calls = []
    real = quack_mlp._GatedMLP.apply
    monkeypatch.setattr(quack_mlp._GatedMLP, "apply",
                        staticmethod(lambda *a: (calls.append(1), real(*a))[1]))
    model = ModelConfig(**MODEL_Q)
    eng = Engine(role="actor", model_cfg=model, ctx=ctx, precision=precision,
                 parallel=ParallelConfig(mlp_kernels=kernels), optim=OptimConfig(lr=1e-3),
                 total_updates=1)
    fill_deterministic(eng.module, num_layers=model.num_layers)
    eng.optimizer.reload_model_params()
    loss_fn = actor_objective(AlgoConfig(), num_tokens=cpu.B * cpu.R, num_seqs=cpu.B)
    metrics = eng.train_step(cpu._batch(0), loss_fn, micro_batch_size=cpu.MICRO)
    grads = {n: p.main_grad.detach().float().clone() for n, p in eng.module.named_parameters()
             if ".mlp." in n and getattr(p, "main_grad", None) is not None}
    return metrics, grads, len(calls)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_engine_gradients_as_close_to_fp32_as_megatrons_mlp(ctx, monkeypatch):
    """bf16 rounds differently on the two paths (quack applies the SwiGLU to fc1's fp32
    accumulator, Megatron to its bf16 output), so each bf16 run is judged against an fp32 one:
    quack's MLP gradients and step metrics within twice the error of Megatron's bf16 MLP (Adam's
    first steps amplify sign flips of tiny gradients, so weights after it are not compared)."""
    m32, g32, _ = _engine_grads(ctx, "fp32", "torch", monkeypatch)
    mt, gt, nt = _engine_grads(ctx, "bf16", "torch", monkeypatch)
    mq, gq, nq = _engine_grads(ctx, "bf16", "quack", monkeypatch)
    from tests.unit import test_wgrad_fusion as cpu

    assert nt == 0 and nq == MODEL_Q["num_layers"] * cpu.B // cpu.MICRO  # layers x micro-batches
    assert g32 and set(gq) == set(g32) == set(gt)
    for name, ref in g32.items():
        et, eq = _rel(gt[name], ref), _rel(gq[name], ref)
        assert eq <= 2 * et + 1e-2, f"{name}: quack {eq:.3e} vs Megatron bf16 {et:.3e} from fp32"
    # the continuous metrics (a clip fraction counts tokens: one of them may flip)
    for key in ("actor/pg_loss", "actor/ppo_kl", "grad_norm"):
        ref = m32[key]
        et, eq = abs(mt[key] - ref) / abs(ref), abs(mq[key] - ref) / abs(ref)
        assert eq <= 2 * et + 2e-2, f"{key}: quack {mq[key]} Megatron bf16 {mt[key]} fp32 {ref}"
