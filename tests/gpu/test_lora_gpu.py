"""LoRA on a GPU (models/lora.py): the merge for generation restores the bf16 weights bit for bit
with its host copies not waited for (pinned, stream-ordered), and the adapter's fused add
(`add_to`: one addmm) equals the base output plus the low-rank update, forward and backward, and
the fused path (`fused_linear`) equals it in bf16."""

import pytest
import torch

from hybridflow.models.lora import LoRAAdapter, merged_adapters
from tests.unit.test_lora_export import _Group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _holder(dtype=torch.bfloat16):
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.linear = torch.nn.Linear(256, 3 * 160, bias=False).to("cuda", dtype)
    holder.linear.lora = LoRAAdapter(
        kind="column", parts=[("q_proj", 128, True), ("k_proj", 16, False), ("v_proj", 16, True)],
        groups=3, in_local=256, in_full=256, rank=8, alpha=16.0, dropout=0.0, tp_group=_Group(),
        tp_rank=0, sequence_parallel=False, dtype=dtype, device="cuda",
        seeds={"q_proj": 1, "v_proj": 2})
    for b in holder.linear.lora.B.values():
        torch.nn.init.normal_(b, std=0.5)
    return holder


def test_merge_restores_bits_on_cuda():
    holder = _holder()
    w = holder.linear.weight
    before = w.detach().clone()
    delta = holder.linear.lora.delta_weight()
    for _ in range(3):  # repeated switches, as every RL step makes
        with merged_adapters(holder, block_rows=100):
            torch.testing.assert_close(w.float(), before.float() + delta, atol=3e-2, rtol=1e-2)
        torch.cuda.synchronize()
        assert torch.equal(w.view(torch.int16), before.view(torch.int16))


def test_add_to_equals_dense_update():
    holder = _holder(torch.float32)
    ad, weight = holder.linear.lora, holder.linear.weight
    x = torch.randn(64, 2, 256, device="cuda", requires_grad=True)
    out = ad.add_to(torch.nn.functional.linear(x, weight), x)
    dense = torch.nn.functional.linear(x, weight + ad.delta_weight())
    torch.testing.assert_close(out, dense, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (gd,) = torch.autograd.grad(dense, x, g)
    torch.testing.assert_close(gx, gd, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("buffers", ["apart", "ddp"])
def test_fused_linear_equals_add_to_in_bf16(buffers):
    """The fused path (base + adapter as one node, the factors' gradients added into fp32
    main_grad by mixed-dtype GEMMs, a gather and multi-tensor adds) against `add_to` + autograd,
    bf16 on CUDA, main_grads apart or in one buffer as DDP lays them out."""
    import types

    from tests.unit.test_lora_fused import _give_main_grads

    holder = _holder()
    ad, weight = holder.linear.lora, holder.linear.weight.requires_grad_(False)
    x = torch.randn(512, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(512, 2, weight.shape[0], device="cuda", dtype=torch.bfloat16)
    ref = ad.add_to(torch.nn.functional.linear(x, weight), x)
    ref_gx, *ref_gf = torch.autograd.grad(ref, [x, *ad.factors()], g)
    _give_main_grads(ad, buffers)
    assert ad.fusable(types.SimpleNamespace(fuse_wgrad=True), weight, None)
    out = ad.fused_linear(x, weight, None)
    assert torch.equal(out, ref)
    out.backward(g)
    torch.testing.assert_close(x.grad, ref_gx, atol=2e-2, rtol=2e-2)
    for p, want in zip(ad.factors(), ref_gf):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, want.float(), atol=0.5, rtol=2e-2)
