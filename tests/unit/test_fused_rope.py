"""parallel.fused_elementwise's RoPE (hybridflow/models/fused.py): the table form it compiles on
CUDA is Megatron's unfused bshd RoPE exactly (fp32, CPU: eager), and CPU tensors, interleaved and
partial rotations go to Megatron's own function. The CUDA kernels: tests/gpu/test_fused_elementwise_gpu.py."""

import torch

from hybridflow.kernels import rope_train
from hybridflow.models import fused


def test_table_form_is_megatrons_rope():
    g = torch.Generator().manual_seed(0)
    t, freqs = torch.randn(7, 2, 3, 16, generator=g), torch.randn(7, 1, 1, 16, generator=g)
    for mscale in (1.0, 0.7):
        cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
        assert torch.equal(rope_train.rope_twin(t, cos, sin),
                           fused._UNFUSED_ROPE(t, freqs, mscale=mscale))


def test_cpu_interleaved_and_partial_use_megatrons(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "_compiled_rope", lambda: calls.append(1))
    t, freqs = torch.randn(5, 1, 2, 8), torch.randn(5, 1, 1, 8)
    for kw in ({}, {"rotary_interleaved": True}):
        assert torch.equal(fused._fused_rope(t, freqs, **kw), fused._UNFUSED_ROPE(t, freqs, **kw))
    half = torch.randn(5, 1, 1, 4)
    assert torch.equal(fused._fused_rope(t, half), fused._UNFUSED_ROPE(t, half))
    assert not calls


def test_tables_made_once_per_freqs_tensor():
    tables = fused._RopeTables()
    freqs = torch.randn(6, 1, 1, 8)
    cos, sin = tables.get(freqs, torch.bfloat16, 1.0)
    assert torch.equal(cos, torch.cos(freqs).to(torch.bfloat16))
    assert torch.equal(sin, torch.sin(freqs).to(torch.bfloat16))
    again = tables.get(freqs, torch.bfloat16, 1.0)
    assert again[0] is cos and again[1] is sin  # every layer's q and k: no new launches
    # another dtype, scale or tensor (even with equal values), or an in-place change: made anew
    assert tables.get(freqs, torch.float32, 1.0)[0].dtype == torch.float32
    assert torch.equal(tables.get(freqs, torch.float32, 0.5)[0], torch.cos(freqs) * 0.5)
    assert tables.get(freqs.clone(), torch.float32, 0.5)[0] is not tables.get(freqs, torch.float32,
                                                                             0.5)[0]
    before = tables.get(freqs, torch.float32, 1.0)[0]
    freqs.mul_(2)
    after = tables.get(freqs, torch.float32, 1.0)[0]
    assert after is not before and torch.equal(after, torch.cos(freqs))
