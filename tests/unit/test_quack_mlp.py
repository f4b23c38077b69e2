"""parallel.mlp_kernels: resolving the option (models/quack_mlp.py) and, off CUDA, a model built
with QuackMLP computing exactly what Megatron's MLP computes (its forward falls back). The fused
GEMMs themselves are checked against fp32 on a GPU in tests/gpu/test_quack_mlp_gpu.py."""

import dataclasses

import pytest
import torch

from hybridflow.config import ModelConfig, ParallelConfig, load_config
from hybridflow.config_checks import validate
from hybridflow.models import quack_mlp
from hybridflow.models.quack_mlp import QuackMLP, quack_unsupported, resolve_mlp_kernels

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, add_qkv_bias=True)


def test_resolve_on_cpu():
    """auto and torch resolve to Megatron's MLP off CUDA; quack or a value not among the choices is
    an error naming the key."""
    cpu = torch.device("cpu")
    assert quack_unsupported(cpu) == "not a CUDA device"
    assert resolve_mlp_kernels("torch", cpu) is False
    assert resolve_mlp_kernels("auto", cpu) is False
    with pytest.raises(ValueError, match="parallel.mlp_kernels=quack cannot run here: not a CUDA"):
        resolve_mlp_kernels("quack", cpu)
    with pytest.raises(ValueError, match="parallel.mlp_kernels='fused': expected one of"):
        resolve_mlp_kernels("fused", cpu)


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(quack_mlp.importlib.util, "find_spec", lambda name: None)
    quack_mlp._quack.cache_clear()
    try:
        assert "quack-kernels is not installed" in quack_mlp._quack()[1]
    finally:
        quack_mlp._quack.cache_clear()


def test_config_rejects_unknown_value():
    cfg = load_config(["parallel.mlp_kernels=cutlass"])
    with pytest.raises(ValueError, match="parallel.mlp_kernels='cutlass'"):
        validate(cfg, world_size=1)
    assert ParallelConfig().mlp_kernels in ("torch", "quack", "auto")


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


def test_cpu_model_equals_megatron_mlp(ctx):
    from hybridflow.models.build import build_model
    from tests.dist.parity_util import fill_deterministic

    out = []
    for quack in (False, True):
        model = build_model(dataclasses.replace(MODEL), role="actor", ctx=ctx, quack_mlp=quack)
        fill_deterministic(model, num_layers=MODEL.num_layers)
        mlps = [type(layer.mlp) for layer in model.decoder.layers]
        assert all((m is QuackMLP) == quack for m in mlps), mlps
        ids = torch.arange(1, 13).view(2, 6) % 50
        pos = torch.arange(6).expand(2, 6)
        out.append(model(ids, pos, None))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_dsl_outside_site_packages_is_named(monkeypatch, tmp_path):
    """quack keys its kernels only when the CUTLASS DSL lives under a site-packages folder."""
    import sys
    import types

    for name, where in (("cutlass", tmp_path / "site" / "cutlass" / "__init__.py"),
                        ("quack", tmp_path / "site" / "quack" / "__init__.py")):
        mod = types.ModuleType(name)
        mod.__file__ = str(where)
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", types.ModuleType("gemm_interface"))
    monkeypatch.setattr(quack_mlp.importlib.util, "find_spec", lambda name: object())
    quack_mlp._quack.cache_clear()
    try:
        gi, why = quack_mlp._quack()
        assert gi is None and "outside a site-packages folder" in why and str(tmp_path) in why
        sys.modules["cutlass"].__file__ = str(tmp_path / "site-packages" / "cutlass" / "x.py")
        quack_mlp._quack.cache_clear()
        assert quack_mlp._quack() == (sys.modules["quack.gemm_interface"], None)
    finally:
        quack_mlp._quack.cache_clear()
