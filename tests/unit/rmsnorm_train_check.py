"""Run by tests/unit/test_rmsnorm_train.py in a fresh interpreter with TRITON_INTERPRET=1 (set
before the first import of the kernels). Prints one JSON object of results."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybridflow.kernels import rmsnorm_train  # noqa: E402
from tests.unit.triton_interp import patch  # noqa: E402

patch()


def case(shape, seed, grad_t=False):
    """The kernel's x and weight gradients against autograd of torch's formula, fp32."""
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = torch.randn(*shape, generator=g) * 3
    w = 1 + 0.2 * torch.randn(N, generator=g)
    grad = torch.randn(*shape, generator=g)
    if grad_t:  # an output gradient that is not contiguous
        grad = torch.randn(*shape[:-2], N, shape[-2], generator=g).transpose(-1, -2)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ya = rmsnorm_train.rms_norm(xa, wa, 1e-6, impl="triton")
    ya.backward(grad)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    yb = F.rms_norm(xb, (N,), wb, 1e-6)
    yb.backward(grad)
    return {"shape": list(shape), "y_err": float((ya - yb).abs().max()),
            "dx_err": float((xa.grad - xb.grad).abs().max() / xb.grad.abs().max()),
            "dw_err": float((wa.grad - wb.grad).abs().max() / wb.grad.abs().max())}


cases = [case((37, 1, 24), 0), case((5, 2, 40), 1), case((300, 16), 2), case((1, 1, 8), 3),
         case((9, 3, 16), 4, grad_t=True), case((41, 1, 896), 5)]
with torch.no_grad():  # forward only: torch's own, no kernel
    x = torch.randn(4, 8)
    no_grad_equal = bool(torch.equal(rmsnorm_train.rms_norm(x, torch.ones(8), 1e-6, impl="triton"),
                                     F.rms_norm(x, (8,), torch.ones(8), 1e-6)))
# no rows (an empty micro-batch's norm): no launch, an empty input gradient, a zero weight gradient
xe, we = torch.randn(0, 1, 16).requires_grad_(), torch.ones(16, requires_grad=True)
rmsnorm_train.rms_norm(xe, we, 1e-6, impl="triton").sum().backward()
empty_ok = xe.grad.shape == xe.shape and bool((we.grad == 0).all())
print(json.dumps({"cases": cases, "no_grad_equal": no_grad_equal, "empty_ok": empty_ok}))
