"""Run by tests/unit/test_swiglu_train.py in a fresh interpreter with TRITON_INTERPRET=1 (set
before the first import of the kernels). Prints one JSON object of results."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybridflow.kernels.swiglu_train import swiglu_backward, swiglu_backward_twin  # noqa: E402
from tests.unit.triton_interp import patch  # noqa: E402

patch()


def autograd_grad(g, z):
    """dz of silu(gate) * up by autograd, in fp64: the reference both are held to."""
    z = z.double().requires_grad_()
    gate, up = z.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(g.double())
    return z.grad


def case(N, f, seed, strided_rows=False):
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(N, 2 * f + (5 if strided_rows else 0), generator=g)
    z = z[:, :2 * f]  # rows further apart than 2F (a view), the last dimension contiguous
    grad = torch.randn(N, f, generator=g)
    want = autograd_grad(grad, z)
    kern = swiglu_backward(grad, z, impl="triton")
    twin = swiglu_backward_twin(grad, z)
    return {"shape": [N, f], "strided_rows": not z.is_contiguous(),
            "kernel_err": float((kern.double() - want).abs().max()),
            "twin_err": float((twin.double() - want).abs().max()),
            "contiguous_out": kern.is_contiguous(), "out_shape": list(kern.shape)}


# widths below, at and above one block (1,024), rows 1 and several, a row stride beyond 2F
result = {"fp32": [case(*shape, seed=i) for i, shape in enumerate(
    [(3, 37), (1, 1024), (4, 1500), (2, 2048)])] + [case(3, 40, seed=7, strided_rows=True)]}
print(json.dumps(result))
