"""kernels/rmsnorm_train.py (parallel.norm_backward=triton: the training passes' RMSNorm
backward in one pass) on CPU through Triton's interpreter (tests/unit/rmsnorm_train_check.py in
a fresh process): the output, the input gradient and the weight gradient equal torch's at fp32,
over row counts that leave programs and row blocks partly empty, widths that are not a power of
two (Qwen2.5-Coder-0.5B's 896 among them), one row, no rows, and an output gradient that is
not contiguous. bf16 on a GPU against fp32:
tests/gpu/test_rmsnorm_train_gpu.py."""

import pytest

from tests.unit.triton_interp import run_check


@pytest.fixture(scope="module")
def checked():
    return run_check("rmsnorm_train_check.py")


def test_kernel_equals_torch(checked):
    assert len(checked["cases"]) == 6
    for case in checked["cases"]:
        assert case["y_err"] == 0.0, case  # the forward is torch's
        assert case["dx_err"] < 1e-5 and case["dw_err"] < 1e-5, case
    assert checked["no_grad_equal"]
    assert checked["empty_ok"]


def test_config_names_the_choices():
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    cfg = load_config(["parallel.norm_backward=apex"])
    with pytest.raises(ValueError, match="parallel.norm_backward='apex' is not one of"):
        validate(cfg, world_size=1)


def test_adopted_model_on_cpu_is_torchs(single_rank_ctx):
    """parallel.norm_backward=triton turns every TorchRMSNorm of a model (the layers' two and the
    final norm) into TritonBackwardRMSNorm; off CUDA it computes exactly torch's."""
    import torch

    from hybridflow.config import ModelConfig
    from hybridflow.models.build import TorchRMSNorm, TritonBackwardRMSNorm, build_model

    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, vocab_size=50)
    torch.manual_seed(0)
    plain = build_model(cfg, role="actor", ctx=single_rank_ctx)
    torch.manual_seed(0)
    ours = build_model(cfg, role="actor", ctx=single_rank_ctx, norm_backward="triton")
    kinds = [type(m) for m in ours.modules() if isinstance(m, TorchRMSNorm)]
    assert kinds == [TritonBackwardRMSNorm] * 5
    ids = torch.randint(0, 50, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    assert torch.equal(plain(ids, pos, None), ours(ids, pos, None))
