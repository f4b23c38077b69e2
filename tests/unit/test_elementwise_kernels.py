"""parallel.elementwise_kernels: refused with the key for an unknown value, and for liger without
liger-kernel; auto resolves to liger only where it is installed; the liger SwiGLU adapter, once
installed into Megatron, hands CPU tensors to Megatron's own function and is taken back by "torch";
a model built for liger has LigerRMSNorm in every norm slot and computes, on CPU, what the torch
build does. The kernels themselves are compared on a GPU (tests/gpu/test_elementwise_gpu.py)."""

import pytest
import torch

from hybridflow.config import ModelConfig
from hybridflow.models import fused


@pytest.mark.parametrize("override,liger,match", [
    ("parallel.elementwise_kernels=triton", True,
     r"parallel.elementwise_kernels='triton': expected one of auto/torch/liger"),
    ("parallel.elementwise_kernels=liger", False,
     r"parallel.elementwise_kernels=liger needs liger-kernel \(pip install liger-kernel"),
])
def test_refused_values(override, liger, match, monkeypatch):
    from hybridflow import config_checks
    from hybridflow.config import load_config

    monkeypatch.setattr(config_checks, "have_liger", lambda: liger)
    cfg = load_config(["experiment=demo", override])
    with pytest.raises(ValueError, match=match):
        config_checks.validate(cfg, world_size=1)


def test_auto_takes_liger_only_where_installed(monkeypatch):
    for installed, expected in ((True, "liger"), (False, "torch")):
        monkeypatch.setattr(fused, "have_liger", lambda: installed)
        assert fused.elementwise_kernels("auto") == expected
    assert fused.elementwise_kernels("torch") == "torch"
    assert fused.elementwise_kernels("liger") == "liger"


def test_swiglu_adapter_installs_and_keeps_megatron_for_cpu_tensors():
    from megatron.core.fusions import fused_bias_swiglu

    original = fused._MEGATRON_SWIGLU
    try:
        fused.use_swiglu_kernel("liger")
        assert fused_bias_swiglu.SwiGLUFunction is fused._LigerSwiGLU
        y = torch.randn(5, 2, 12, requires_grad=True)
        out = fused_bias_swiglu.bias_swiglu_impl(y, None)
        a, b = y.chunk(2, -1)
        torch.testing.assert_close(out, torch.nn.functional.silu(a) * b)
        out.sum().backward()
        assert y.grad is not None and y.grad.isfinite().all()
        fused.use_swiglu_kernel("torch")
        assert fused_bias_swiglu.SwiGLUFunction is original
        fused.use_swiglu_kernel("liger")
        fused.use_swiglu_kernel("liger")  # twice: still Megatron's underneath
        assert fused._LigerSwiGLU.megatron is original
    finally:
        fused.use_swiglu_kernel("torch")


def test_liger_build_puts_its_norm_in_every_slot_and_computes_the_same_on_cpu(single_rank_ctx):
    from hybridflow.models.build import LigerRMSNorm, TorchRMSNorm, build_model

    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, vocab_size=50, qk_layernorm=True)
    out, kinds = {}, {}
    try:
        for kind in ("torch", "liger"):
            torch.manual_seed(0)
            model = build_model(cfg, role="actor", ctx=single_rank_ctx, fused_elementwise=True,
                                elementwise=kind)
            kinds[kind] = {type(m) for m in model.modules() if isinstance(m, TorchRMSNorm)}
            ids = torch.arange(12).view(1, 12) % 50
            out[kind] = model(ids, torch.arange(12).view(1, 12), None)
    finally:
        fused.use_swiglu_kernel("torch")
    assert kinds == {"torch": {TorchRMSNorm}, "liger": {LigerRMSNorm}}
    # 2 layers x (input, pre-MLP, q, k) + the final norm, all of the chosen kind
    assert len([m for m in model.modules() if isinstance(m, LigerRMSNorm)]) == 9
    torch.testing.assert_close(out["liger"], out["torch"])
