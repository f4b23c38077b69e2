"""Run by tests/unit/test_rmsnorm_wgrad.py in a fresh interpreter with TRITON_INTERPRET=1 (set
before the first import of the kernels). Prints one JSON object of results."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hybridflow.kernels import rmsnorm_wgrad  # noqa: E402
from tests.unit.triton_interp import patch  # noqa: E402

patch()


def case(shape, seed):
    """The kernel's weight gradient against autograd of torch's RMSNorm in fp64."""
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = torch.randn(*shape, generator=g) * 3
    w = 1 + 0.2 * torch.randn(N, generator=g)
    grad = torch.randn(*shape, generator=g)
    x64, w64 = x.double(), w.double().requires_grad_()
    torch.nn.functional.rms_norm(x64, (N,), w64, 1e-6).backward(grad.double())
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    ours = rmsnorm_wgrad.weight_grad(grad, x, rstd, impl="triton")
    twin = rmsnorm_wgrad.weight_grad(grad, x, rstd, impl="torch")
    scale = float(w64.grad.abs().max())
    return {"shape": list(shape), "dtype": str(ours.dtype), "out_shape": list(ours.shape),
            "dw_err": float((ours.double() - w64.grad).abs().max()) / scale,
            "twin_err": float((ours - twin).abs().max()) / scale}


# rows that leave splits and row blocks partly empty; widths under, at and over a column block,
# not powers of two (896: Qwen2.5-Coder-0.5B); one row; 3-D input as the layers pass it
cases = [case((300, 896), 0), case((1, 896), 1), case((77, 200), 2), case((33, 64), 3),
         case((5, 13, 136), 4)]
empty = rmsnorm_wgrad.weight_grad(torch.empty(0, 40), torch.empty(0, 40), torch.empty(0, 1),
                                  impl="triton")
print(json.dumps({"cases": cases, "empty_zero": bool(torch.equal(empty, torch.zeros(40)))}))
