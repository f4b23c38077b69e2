"""kernels/swiglu_train.py (the training SwiGLU's backward on CUDA, parallel.swiglu_backward=triton,
models/fused.py) on CPU through Triton's interpreter (tests/unit/swiglu_train_check.py in a fresh
process): the input gradient of silu(gate) * up equal autograd's at fp32 for widths below, at and
above one block, one and several rows and rows strided beyond 2F; the twin alike; shapes it does not
take raise a clear error. bf16 on a GPU against Megatron's compiled backward, and the model with it:
tests/gpu/test_swiglu_train_gpu.py."""

import pytest
import torch

from tests.unit.triton_interp import run_check


@pytest.fixture(scope="module")
def checked():
    return run_check("swiglu_train_check.py")


def test_kernel_and_twin_equal_autograd(checked):
    assert [c["shape"] for c in checked["fp32"]] == [[3, 37], [1, 1024], [4, 1500], [2, 2048],
                                                     [3, 40]]
    assert checked["fp32"][-1]["strided_rows"]
    for c in checked["fp32"]:
        assert c["contiguous_out"] and c["out_shape"] == [c["shape"][0], 2 * c["shape"][1]], c
        assert c["kernel_err"] < 1e-5 and c["twin_err"] < 1e-5, c


def test_shapes_it_does_not_take_raise():
    from hybridflow.kernels.swiglu_train import supported, swiglu_backward

    z, g = torch.randn(4, 10), torch.randn(4, 5)
    assert supported(g, z)
    assert not supported(torch.randn(4, 6), z)  # not half of z's width
    assert not supported(g.double(), z)  # another dtype
    assert not supported(torch.randn(5, 4).t(), z)  # the last dimension strided
    with pytest.raises(ValueError, match=r"z \(4, 10\).*g \(4, 6\)"):
        swiglu_backward(torch.randn(4, 6), z)


def test_option_is_checked():
    from hybridflow.config import Config
    from hybridflow.config_checks import validate

    cfg = Config()
    cfg.parallel.swiglu_backward = "cuda"
    with pytest.raises(ValueError, match="parallel.swiglu_backward"):
        validate(cfg, world_size=1)
