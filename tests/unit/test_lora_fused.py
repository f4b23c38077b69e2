"""The fused LoRA linear (models/lora.py `LoRAAdapter.fused_linear`: base + update as one autograd
node, the factors' gradients added into their main_grad) against the autograd path (`add_to` on
the base output, gradients through autograd into `.grad`), on QKV's grouped layout with an
untargeted part, [gate; up] and a row-parallel linear, fp32 on CPU: the same output bits, the same
input gradient and factor gradients; no factor gets a `.grad`; the GEMM matrices are built once
inside `factors_fixed` and anew outside it."""

import types

import pytest
import torch
import torch.nn.functional as F

from hybridflow.models.lora import LoRAAdapter, factors_fixed
from tests.unit.test_lora_export import _Group

LAYOUTS = {  # kind, parts, groups, in, rank, alpha
    "qkv": ("column", [("q_proj", 32, True), ("k_proj", 8, False), ("v_proj", 8, True)], 3, 40, 4,
            8.0),
    "fc1": ("column", [("gate_proj", 24, True), ("up_proj", 24, True)], 1, 40, 4, 6.0),
    "fc2": ("row", [("down_proj", 40, True)], 1, 24, 4, 8.0),
}


def _adapter(layout: str):
    kind, parts, groups, fan_in, rank, alpha = LAYOUTS[layout]
    ad = LoRAAdapter(kind=kind, parts=parts, groups=groups, in_local=fan_in, in_full=fan_in,
                     rank=rank, alpha=alpha, dropout=0.0, tp_group=_Group(), tp_rank=0,
                     sequence_parallel=False, dtype=torch.float32, device="cpu",
                     seeds={n: i + 1 for i, (n, _, _) in enumerate(parts)})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in ad.B.values():
            b.copy_(torch.randn(b.shape, generator=g))
    out = groups * sum(n for _, n, _ in parts)
    weight = torch.randn(out, fan_in, generator=g)
    bias = torch.randn(out, generator=g) if layout == "qkv" else None
    return ad, weight, bias


def _b_reference(ad: LoRAAdapter) -> torch.Tensor:
    """scale * B over the concatenated columns, built part by part with explicit zeros."""
    names, r = list(ad.B), ad.rank
    blocks = []
    for name, rows, targeted in ad.parts:
        blk = torch.zeros(ad.groups, rows, len(names) * r)
        if targeted:
            j = names.index(name)
            blk[:, :, j * r:(j + 1) * r] = ad.B[name].detach().view(ad.groups, rows, r)
        blocks.append(blk)
    return torch.cat(blocks, 1).reshape(-1, len(names) * r) * ad.scale


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_linear_matches_autograd_path(layout):
    ad, weight, bias = _adapter(layout)
    torch.testing.assert_close(ad.b_matrix(), _b_reference(ad), rtol=0, atol=0)
    x = torch.randn(6, 2, weight.shape[1], generator=torch.Generator().manual_seed(5),
                    requires_grad=True)
    g = torch.randn(6, 2, weight.shape[0], generator=torch.Generator().manual_seed(6))

    ref = ad.add_to(F.linear(x, weight, bias), x)
    ref_gx, *ref_gf = torch.autograd.grad(ref, [x, *ad.factors()], g)

    layer = types.SimpleNamespace(fuse_wgrad=True)
    assert not ad.fusable(layer, weight, bias)  # no main_grad yet: the autograd path
    for p in ad.factors():
        p.main_grad = torch.zeros_like(p)
    assert ad.fusable(layer, weight, bias)
    assert not ad.fusable(types.SimpleNamespace(fuse_wgrad=False), weight, bias)
    assert not ad.fusable(layer, weight.requires_grad_(True), bias)  # a trained base
    weight.requires_grad_(False)
    out = ad.fused_linear(x, weight, bias)
    assert type(out.grad_fn).__name__ == "_FusedLoRALinearBackward"
    assert torch.equal(out, ref)  # the same GEMMs: the same bits
    out.backward(g)
    torch.testing.assert_close(x.grad, ref_gx, rtol=1e-5, atol=1e-5)
    for p, want in zip(ad.factors(), ref_gf):
        assert p.grad is None  # gradients only in main_grad: no AccumulateGrad, no DDP hook work
        torch.testing.assert_close(p.main_grad, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # forward-only passes: the same values without the autograd node
        assert torch.equal(ad.fused_linear(x, weight, bias), ref)


def test_gemm_factors_fixed_only_inside_the_pass():
    ad, weight, _ = _adapter("qkv")
    holder = torch.nn.Module()
    holder.linear = torch.nn.Linear(1, 1)
    holder.linear.lora = ad
    first = ad.gemm_factors()
    assert ad.gemm_factors()[1] is not first[1]  # outside: made anew each call
    with factors_fixed(holder):
        a, b = ad.gemm_factors()
        assert ad.gemm_factors()[1] is b  # one pass: made once
    with torch.no_grad():  # as the optimizer writes: through .data, no version counter moves
        next(iter(ad.B.values())).data.add_(1.0)
    a2, b2 = ad.gemm_factors()
    assert not torch.equal(b2, b)
    torch.testing.assert_close(b2, _b_reference(ad), rtol=0, atol=0)
