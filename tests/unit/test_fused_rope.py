"""parallel.fused_elementwise's RoPE (hybridflow/models/fused.py): the table form it compiles on
CUDA is Megatron's unfused bshd RoPE exactly (fp32, CPU: eager), and CPU tensors, interleaved and
partial rotations go to Megatron's own function. The CUDA kernels: tests/gpu/test_fused_elementwise_gpu.py."""

import pytest
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


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_from_qkv_hands_over_the_projections_view_and_changes_nothing(single_rank_ctx,
                                                                          monkeypatch, qk_norm):
    """parallel.rope_from_qkv: SelfAttention hands q to the RoPE as the QKV projection groups it
    (a 5-D view, no copy) and the model computes exactly what it computes without (CPU: the view
    reshaped as Megatron reshapes it, then Megatron's RoPE); a q / k norm keeps Megatron's path."""
    from megatron.core.models.common.embeddings import rope_utils

    from hybridflow.config import ModelConfig
    from hybridflow.models.build import build_model

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, vocab_size=50, add_qkv_bias=True, qk_layernorm=qk_norm)
    seen = []

    def spy(t, freqs, **kw):
        seen.append(t.dim())
        return fused._fused_rope(t, freqs, **kw)

    def run(model, grouped, ids):
        fused.use_rope_from_qkv(grouped)
        seen.clear()
        model.zero_grad(set_to_none=True)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        out = model(ids, pos, None)
        out.float().square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, list(seen)

    try:
        torch.manual_seed(0)
        plain = build_model(cfg, role="actor", ctx=single_rank_ctx, fused_elementwise=True)
        grouped = build_model(cfg, role="actor", ctx=single_rank_ctx, fused_elementwise=True,
                              rope_from_qkv=True)
        grouped.load_state_dict(plain.state_dict())
        monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", spy)
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        out0, g0, dims0 = run(plain, False, ids)
        out1, g1, dims1 = run(grouped, True, ids)
        assert dims0 == [4] * 4  # q and k of each layer
        assert dims1 == ([4] * 4 if qk_norm else [5, 4] * 2)  # q as the projection's groups
        assert torch.equal(out1, out0)
        for n in g0:
            assert torch.equal(g1[n], g0[n]), n
    finally:
        fused.use_rope_from_qkv(False)
        fused.use_fused_rope(False)
