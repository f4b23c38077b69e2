"""kernels/rope_train.py on a GPU in bf16: the Triton RoPE's output and input gradient against the
fp32 formula, as close as the compiled kernel it replaced (now the fallback), on q and k split
from a QKV projection the way Megatron splits them, at Qwen2.5-Coder-0.5B's head layout."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _tables(S, D):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(S, device="cuda", dtype=torch.float32), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    return torch.cos(freqs), torch.sin(freqs)


@pytest.mark.parametrize("S", [1, 777, 20480])
def test_bf16_against_fp32(S):
    from hybridflow.kernels.rope_train import rope, rope_twin
    from hybridflow.models.fused import _compiled_rope

    G, hpg, D = 2, 7, 64
    g = torch.Generator(device="cuda").manual_seed(S)
    qkv = torch.randn(S, 1, G, (hpg + 2) * D, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, _ = torch.split(qkv, [hpg * D, D, D], dim=3)
    cos32, sin32 = _tables(S, D)
    cos, sin = cos32.bfloat16(), sin32.bfloat16()
    for t in (q.reshape(S, 1, G * hpg, D), k):
        grad = torch.randn(t.shape, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = t.detach().float().requires_grad_()
        rope_twin(ref, cos32, sin32).backward(grad.float())
        errs = {}
        for name, fn in (("triton", lambda x: rope(x, cos, sin, impl="triton")),
                         ("compiled", lambda x: _compiled_rope()(x, cos, sin))):
            x = t.detach().clone().requires_grad_()
            y = fn(x)
            y.backward(grad)
            want = rope_twin(ref.detach(), cos32, sin32)
            errs[name] = (float((y.float() - want).abs().max()),
                          float((x.grad.float() - ref.grad).abs().max()))
        scale = float(t.float().abs().max())
        # bf16 tables and one rounding of the result: a few bf16 ulps of the largest value
        assert errs["triton"][0] < 0.03 * scale and errs["triton"][1] < 0.03 * scale, errs
        assert errs["triton"][0] <= 2 * errs["compiled"][0] + 1e-6, errs
        assert errs["triton"][1] <= 2 * errs["compiled"][1] + 1e-6, errs
