"""The fused LoRA linear (models/lora.py `LoRAAdapter.fused_linear`: base + update as one autograd
node, the factors' gradients added into their main_grad) against the autograd path (`add_to` on
the base output, gradients through autograd into `.grad`), on QKV's grouped layout with an
untargeted part or with q alone, [gate; up] and a row-parallel linear, fp32 on CPU, the main_grads
apart or in one buffer as Megatron's DDP lays them out: the same output bits, the same input
gradient and factor gradients; no factor gets a `.grad`; the GEMM plan is made once inside
`factors_fixed` and anew outside it. bf16 factors with fp32 main_grads (the CPU's mixed-dtype
branches) match within bf16's rounding."""

import types

import pytest
import torch
import torch.nn.functional as F

from hybridflow.models.lora import LoRAAdapter, factors_fixed
from tests.unit.test_lora_export import _Group

LAYOUTS = {  # kind, parts, groups, in, rank, alpha
    "qkv": ("column", [("q_proj", 32, True), ("k_proj", 8, False), ("v_proj", 8, True)], 3, 40, 4,
            8.0),
    "q_only": ("column", [("q_proj", 32, True), ("k_proj", 8, False), ("v_proj", 8, False)], 3,
               40, 4, 6.0),
    "fc1": ("column", [("gate_proj", 24, True), ("up_proj", 24, True)], 1, 40, 4, 6.0),
    "fc2": ("row", [("down_proj", 40, True)], 1, 24, 4, 8.0),
}


def _adapter(layout: str, dtype=torch.float32):
    kind, parts, groups, fan_in, rank, alpha = LAYOUTS[layout]
    ad = LoRAAdapter(kind=kind, parts=parts, groups=groups, in_local=fan_in, in_full=fan_in,
                     rank=rank, alpha=alpha, dropout=0.0, tp_group=_Group(), tp_rank=0,
                     sequence_parallel=False, dtype=dtype, device="cpu",
                     seeds={n: i + 1 for i, (n, _, _) in enumerate(parts)})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in ad.B.values():
            b.copy_(torch.randn(b.shape, generator=g))
    out = groups * sum(n for _, n, _ in parts)
    weight = torch.randn(out, fan_in, generator=g).to(dtype)
    bias = torch.randn(out, generator=g).to(dtype) if layout == "qkv" else None
    return ad, weight, bias


def _give_main_grads(ad: LoRAAdapter, buffers: str) -> None:
    """fp32 main_grads: "apart" (one tensor each) or "ddp" (views of one buffer, back to back in
    reverse parameter order, as Megatron's DDP lays them out)."""
    if buffers == "apart":
        for p in ad.factors():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        return
    params = list(ad.parameters())[::-1]
    buf, off = torch.zeros(sum(p.numel() for p in params), device=params[0].device), 0
    for p in params:
        p.main_grad = buf[off:off + p.numel()].view(p.shape)
        off += p.numel()


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


@pytest.mark.parametrize("buffers", ["apart", "ddp"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_linear_matches_autograd_path(layout, buffers):
    ad, weight, bias = _adapter(layout)
    torch.testing.assert_close(ad.b_matrix(), _b_reference(ad), rtol=0, atol=0)
    x = torch.randn(6, 2, weight.shape[1], generator=torch.Generator().manual_seed(5),
                    requires_grad=True)
    g = torch.randn(6, 2, weight.shape[0], generator=torch.Generator().manual_seed(6))

    ref = ad.add_to(F.linear(x, weight, bias), x)
    ref_gx, *ref_gf = torch.autograd.grad(ref, [x, *ad.factors()], g)

    layer = types.SimpleNamespace(fuse_wgrad=True)
    assert not ad.fusable(layer, weight, bias)  # no main_grad yet: the autograd path
    _give_main_grads(ad, buffers)
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


@pytest.mark.parametrize("layout", ["qkv", "fc2"])
def test_fused_linear_bf16_factors_fp32_main_grads(layout):
    ad, weight, bias = _adapter(layout, torch.bfloat16)
    x = torch.randn(6, 2, weight.shape[1], generator=torch.Generator().manual_seed(5))
    x = x.bfloat16().requires_grad_(True)
    g = torch.randn(6, 2, weight.shape[0], generator=torch.Generator().manual_seed(6)).bfloat16()
    ref = ad.add_to(F.linear(x, weight, bias), x)
    ref_gx, *ref_gf = torch.autograd.grad(ref, [x, *ad.factors()], g)
    _give_main_grads(ad, "ddp")
    out = ad.fused_linear(x, weight, bias)
    assert torch.equal(out, ref)
    out.backward(g)
    torch.testing.assert_close(x.grad, ref_gx, rtol=2e-2, atol=2e-2)
    for p, want in zip(ad.factors(), ref_gf):
        assert p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.main_grad, want.float(), rtol=2e-2, atol=5e-2)


def test_gemm_plan_fixed_only_inside_the_pass():
    ad, weight, _ = _adapter("qkv")
    holder = torch.nn.Module()
    holder.linear = torch.nn.Linear(1, 1)
    holder.linear.lora = ad
    first = ad.gemm_plan()
    assert ad.gemm_plan().b is not first.b  # outside: made anew each call
    with factors_fixed(holder):
        plan = ad.gemm_plan()
        assert ad.gemm_plan() is plan  # one pass: made once
    with torch.no_grad():  # as the optimizer writes: through .data, no version counter moves
        next(iter(ad.B.values())).data.add_(1.0)
    plan2 = ad.gemm_plan()
    assert not torch.equal(plan2.b, plan.b)
    torch.testing.assert_close(plan2.b, _b_reference(ad), rtol=0, atol=0)
