"""parallel.gradient_accumulation_fusion on a GPU: bf16 weight gradients accumulated into the fp32
main_grad by one mixed-dtype GEMM (in place), and the Engine's bf16 update with it against the one
DDP's hooks give (tests/unit/test_wgrad_fusion.py does the same on CPU, where the fused path falls
back to a GEMM and an add)."""

import pytest
import torch

from hybridflow.models import linear

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_accumulate_wgrad_mixed_dtype_in_place():
    g = torch.Generator(device="cuda").manual_seed(0)
    main = torch.randn(1536, 896, device="cuda", generator=g)
    grad = torch.randn(3072, 1536, device="cuda", generator=g).bfloat16()
    x = torch.randn(3072, 896, device="cuda", generator=g).bfloat16()
    want = main + grad.float().t() @ x.float()
    ptr = main.data_ptr()
    linear.accumulate_wgrad(main, grad, x)
    assert main.data_ptr() == ptr and main.dtype == torch.float32
    # fp32 accumulation of exact bf16 x bf16 products: only summation order differs
    torch.testing.assert_close(main, want, rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def test_engine_bf16_fused_matches_hooks(ctx, monkeypatch):
    from tests.unit import test_wgrad_fusion as cpu

    m_ref, w_ref, n_ref, _ = cpu._steps(ctx, "bf16", False, monkeypatch)
    m, w, n, _ = cpu._steps(ctx, "bf16", True, monkeypatch)
    assert n_ref == 0 and n == 4 * cpu.MODEL.num_layers * 2 * 2
    # fused: each micro-batch's weight gradient reaches main_grad in fp32, not rounded to bf16 first
    tol = dict(rtol=2e-2, atol=2.5e-3)
    for a, b in zip(m, m_ref):
        for key in b:
            torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), **tol)
    for name in w_ref:
        torch.testing.assert_close(w[name], w_ref[name], **tol)
