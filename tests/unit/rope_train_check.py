"""Run by tests/unit/test_rope_train.py in a fresh interpreter with TRITON_INTERPRET=1 (set
before the first import of the kernels). Prints one JSON object of results."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hybridflow.kernels.rope_train import rope, rope_twin  # noqa: E402
from tests.unit.triton_interp import patch  # noqa: E402

patch()


def tables(S, D, g):
    """Megatron's rotate-half tables: (S, 1, 1, D), each half the same frequencies."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(S, dtype=torch.float32) + 7 * torch.rand(1, generator=g), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    return torch.cos(freqs), torch.sin(freqs)


def case(S, B, G, hpg, D, seed):
    """q and k as Megatron splits them from the QKV projection (S, B, G, (hpg+2)D): k a strided
    view, q reshaped to (S, B, G * hpg, D) (a view for one KV group, else a copy)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, B, G, (hpg + 2) * D, generator=g)
    q, k, _ = torch.split(qkv, [hpg * D, D, D], dim=3)
    grouped = q.unflatten(3, (hpg, D))  # q where the projection put it (parallel.rope_from_qkv)
    q = q.reshape(S, B, G * hpg, D)
    cos, sin = tables(S, D, g)
    out = {}
    for name, t in (("q", q), ("k", k), ("q_grouped", grouped)):
        x = t.detach().clone().requires_grad_()
        ref = t.detach().clone().requires_grad_()
        y = rope(x, cos, sin, impl="triton")
        want = rope_twin(ref, cos, sin)
        grad = torch.randn(want.shape, generator=g)
        y.backward(grad)
        want.backward(grad)
        out[name] = {"strided_input": not t.is_contiguous(), "contiguous_out": y.is_contiguous(),
                     "out_shape": list(y.shape), "grad_shape": list(x.grad.shape),
                     "fwd_err": float((y - want).abs().max()),
                     "bwd_err": float((x.grad - ref.grad).abs().max())}
    return out


result = {"fp32": [case(*shape, seed=i) for i, shape in enumerate(
    [(5, 1, 2, 7, 16), (9, 2, 1, 3, 32), (1, 1, 2, 1, 8), (33, 1, 2, 7, 64)])]}
# a non-contiguous output gradient (a transpose's) is rotated as well
g = torch.Generator().manual_seed(9)
x = torch.randn(6, 1, 3, 16, generator=g).requires_grad_()
cos, sin = tables(6, 16, g)
grad = torch.randn(6, 1, 16, 3, generator=g).transpose(2, 3)
rope(x, cos, sin, impl="triton").backward(grad)
ref = x.detach().clone().requires_grad_()
rope_twin(ref, cos, sin).backward(grad)
result["strided_grad_err"] = float((x.grad - ref.grad).abs().max())
print(json.dumps(result))
