"""kernels/rmsnorm_wgrad.py (parallel.norm_wgrad=triton: the training passes' RMSNorm weight
gradient as a Triton column reduction) on CPU through Triton's interpreter
(tests/unit/rmsnorm_wgrad_check.py in a fresh process): the weight gradient equals autograd of
torch's RMSNorm (fp64) over row counts that leave row splits and blocks partly empty, widths that
are not a multiple of the column block (Qwen2.5-Coder-0.5B's 896 among them), one row, 3-D input
and no rows. The whole norm (torch's fused forward and input gradient, which exist on CUDA only)
in bf16 against fp32: tests/gpu/test_rmsnorm_wgrad_gpu.py."""

import pytest

from tests.unit.triton_interp import run_check


@pytest.fixture(scope="module")
def checked():
    return run_check("rmsnorm_wgrad_check.py")


def test_kernel_equals_autograd(checked):
    assert len(checked["cases"]) == 5
    for case in checked["cases"]:
        assert case["dtype"] == "torch.float32" and case["out_shape"] == case["shape"][-1:]
        assert case["dw_err"] < 1e-5 and case["twin_err"] < 1e-5, case
    assert checked["empty_zero"]


def test_off_cuda_it_is_torchs():
    import torch

    from hybridflow.kernels.rmsnorm_wgrad import rms_norm

    x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    assert torch.equal(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (8,), w, 1e-6))


def test_config_names_the_choices():
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    cfg = load_config(["parallel.norm_wgrad=apex"])
    with pytest.raises(ValueError, match="parallel.norm_wgrad='apex' is not one of"):
        validate(cfg, world_size=1)


def test_model_flags_every_norm_and_stays_torchs_on_cpu(single_rank_ctx):
    """norm_wgrad flags every TorchRMSNorm of a model (the layers' two and the final norm); off
    CUDA the model computes exactly torch's."""
    import torch

    from hybridflow.config import ModelConfig
    from hybridflow.models.build import TorchRMSNorm, build_model

    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, vocab_size=50)
    model = build_model(cfg, role="actor", ctx=single_rank_ctx, norm_wgrad=True)
    norms = [m for m in model.modules() if isinstance(m, TorchRMSNorm)]
    assert len(norms) == 5 and all(m.wgrad_kernel for m in norms)
    ids = torch.randint(0, 50, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    ours = model(ids, pos, None)
    for m in norms:
        m.wgrad_kernel = False
    assert torch.equal(ours, model(ids, pos, None))
