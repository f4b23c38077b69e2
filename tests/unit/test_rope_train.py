"""kernels/rope_train.py (the training passes' RoPE on CUDA, models/fused.py) on CPU through
Triton's interpreter (tests/unit/rope_train_check.py in a fresh process): forward and backward
equal the PyTorch formula at fp32 on q and k as the strided views Megatron splits from the QKV
projection (1 and 2 sequences a position, heads not a power of two, one position, the
Qwen2.5-Coder-0.5B layout of 14 q heads in 2 groups of head_dim 64), q also as the projection
groups it (S, B, G, H / G, D) (parallel.rope_from_qkv), and for an
output gradient that is not contiguous. bf16 on a GPU, against fp32: tests/gpu/test_rope_train_gpu.py;
the model with it or with the compiled fallback: tests/gpu/test_fused_elementwise_gpu.py."""

import pytest

from tests.unit.triton_interp import run_check


@pytest.fixture(scope="module")
def checked():
    return run_check("rope_train_check.py")


def test_kernel_equals_the_formula(checked):
    for case in checked["fp32"]:
        assert case["k"]["strided_input"]  # (q is a copy where there are several KV groups)
        assert case["q_grouped"]["strided_input"]  # the projection's view: rotated without a copy
        # the grouped q comes out as Megatron's (S, B, H, D); its gradient in the view's shape
        assert case["q_grouped"]["out_shape"] == case["q"]["out_shape"]
        assert len(case["q_grouped"]["grad_shape"]) == 5
        for side in case.values():
            assert side["contiguous_out"], side
            assert side["fwd_err"] < 1e-6 and side["bwd_err"] < 1e-6, side
    assert checked["strided_grad_err"] < 1e-6


def test_shapes_it_does_not_take_fall_back():
    import torch

    from hybridflow.kernels.rope_train import rope, rope_twin, supported

    t = torch.randn(4, 1, 2, 12)  # head_dim half 6: not a power of two
    cos, sin = torch.randn(4, 1, 1, 12), torch.randn(4, 1, 1, 12)
    assert not supported(t, cos)
    assert supported(torch.randn(4, 1, 2, 16), torch.randn(4, 1, 1, 16))
    assert not supported(torch.randn(4, 1, 2, 16), torch.randn(3, 1, 1, 16))  # other positions
    assert torch.equal(rope(t, cos, sin, impl="triton"), rope_twin(t, cos, sin))
