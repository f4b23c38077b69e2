"""checkpoint.optim.use_fused_adam on a GPU: torch's AdamW switched to its fused kernels after
construction (as Megatron builds it) updates as the foreach one does, also after a state load that
brings back the saved flags and CPU step tensors (what a checkpoint resume does)."""

import copy
from types import SimpleNamespace

import pytest
import torch

from hybridflow.checkpoint.optim import use_fused_adam

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _params(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(n, generator=g, device="cuda", requires_grad=True) for n in (7, 300, 4096)]


def _steps(opt, params, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(k):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, device="cuda")
        opt.step()


def test_fused_equals_foreach_and_survives_a_state_load():
    ref_p, fused_p = _params(0), _params(0)
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(ref_p, foreach=True, **kw)
    fused = torch.optim.AdamW(fused_p, **kw)
    part = SimpleNamespace(optimizer=fused)
    use_fused_adam(part)
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    _steps(ref, ref_p, 3, seed=1)
    _steps(fused, fused_p, 3, seed=1)
    # a resume: the saved groups (foreach flags) and CPU step tensors come back
    sd = copy.deepcopy(ref.state_dict())  # as from disk: no state tensor shared with `ref`
    for st in sd["state"].values():
        st["step"] = st["step"].cpu()
    fused.load_state_dict(sd)
    for p, q in zip(ref_p, fused_p):
        q.data.copy_(p.data)
    use_fused_adam(part)
    assert all(g["fused"] for g in fused.param_groups)
    assert all(st["step"].is_cuda for st in fused.state.values())
    _steps(ref, ref_p, 2, seed=2)
    _steps(fused, fused_p, 2, seed=2)
    for p, q in zip(ref_p, fused_p):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert int(fused.state[fused_p[0]]["step"]) == 5
