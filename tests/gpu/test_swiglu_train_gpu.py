"""parallel.swiglu_backward=triton on a GPU (kernels/swiglu_train.py, installed by models/fused.py):
the kernel against Megatron's compiled swiglu_back in bf16 at the GSM8K recipe's MLP width and at
widths off the block, both held to fp64 autograd; the training model built with it gives the loss
and gradients of the model on Megatron's backward (fp32: to rounding; bf16: within bf16 rounding)."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import ModelConfig

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

CFG = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                  num_query_groups=2, vocab_size=100)


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


@pytest.mark.parametrize("shape", [(2048, 4864), (37, 1500), (5, 96)])
def test_kernel_matches_megatrons_backward(shape):
    from megatron.core.fusions.fused_bias_swiglu import swiglu_back

    from hybridflow.kernels.swiglu_train import swiglu_backward

    n, f = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (3 * torch.randn(n, 2 * f, device="cuda", generator=g)).to(torch.bfloat16)
    grad = torch.randn(n, f, device="cuda", generator=g).to(torch.bfloat16)
    ours, theirs = swiglu_backward(grad, z), swiglu_back(grad, z)
    zz = z.double().requires_grad_()
    gate, up = zz.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad.double())
    exact = zz.grad
    # both round an fp32 result once: within one bf16 step of it, and mostly the same bits
    ulp = exact.abs().clamp(min=1e-30) * 2 ** -7
    assert ((ours.double() - exact).abs() <= ulp).all()
    assert ((theirs.double() - exact).abs() <= ulp).all()
    assert (ours == theirs).float().mean() > 0.99


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_with_it_equals_megatrons(ctx, precision):
    from hybridflow.models import fused as fused_mod
    from hybridflow.models.build import build_model
    from hybridflow.models.logprob import vocab_parallel_logprobs

    def build(kind):
        torch.manual_seed(0)
        m = build_model(CFG, role="actor", ctx=ctx, precision=precision, fused_elementwise=True,
                        swiglu_backward=kind).cuda()
        return m.to(torch.bfloat16) if precision == "bf16" else m

    def step(model, kind, ids):
        fused_mod.use_fused_swiglu(kind == "triton")
        model.zero_grad(set_to_none=True)
        pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
        lp = vocab_parallel_logprobs(model(ids, pos, None).float(), torch.roll(ids, -1, 1),
                                     tp_group=None, true_vocab_size=CFG.vocab_size)
        (-lp.mean()).backward()
        return lp.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}

    try:
        theirs = build("compiled")
        ours = build("triton")
        ours.load_state_dict(theirs.state_dict())
        ids = torch.randint(0, CFG.vocab_size, (3, 64), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(1))
        lp0, g0 = step(theirs, "compiled", ids)
        lp1, g1 = step(ours, "triton", ids)
        tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lp1, lp0, **tol)
        for n in g0:
            err = (g1[n] - g0[n]).norm() / g0[n].norm().clamp(min=1e-12)
            assert err < (1e-5 if precision == "fp32" else 1e-2), (n, err.item())
    finally:
        fused_mod.use_fused_swiglu(False)
