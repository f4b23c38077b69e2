"""SDPAttention's route around the cuDNN backward NaN (hybridflow/models/attention.py): which calls
take it, and that the route computes the same attention and gradients as the default dispatch."""

import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from hybridflow.engine import attention_mask
from hybridflow.models import attention
from hybridflow.models.attention import SDPAttention, cudnn_backward_unsafe, sdpa_without_cudnn


def _cuda_like(requires_grad=True):
    return types.SimpleNamespace(is_cuda=True, requires_grad=requires_grad)


@pytest.mark.parametrize("length,unsafe", [(64, True), (704, True), (1088, True), (640, False),
                                           (768, False), (1181, False), (705, False)])
def test_unsafe_lengths(length, unsafe):
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    assert cudnn_backward_unsafe(_cuda_like(), length, length, mask) is unsafe


def test_only_masked_differentiated_cuda_calls():
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    assert not cudnn_backward_unsafe(_cuda_like(), 704, 704, None)  # is_causal path: clean
    assert not cudnn_backward_unsafe(_cuda_like(requires_grad=False), 704, 704, mask)
    with torch.no_grad():
        assert not cudnn_backward_unsafe(_cuda_like(), 704, 704, mask)
    cpu = torch.zeros(1, requires_grad=True)
    assert not cudnn_backward_unsafe(cpu, 704, 704, mask)
    assert cudnn_backward_unsafe(_cuda_like(), 1, 192, mask)  # either length


def _qkv(b=3, nh=6, nkv=2, s=20, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, s, d, generator=g, requires_grad=True)
    k = torch.randn(b, nkv, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, nkv, s, d, generator=g, requires_grad=True)
    return q, k, v


def _padded_mask(b, s):
    tokens = torch.ones(b, s, dtype=torch.long)
    tokens[0, :5] = 0   # left-padded prompt
    tokens[1, -4:] = 0  # right-padded response
    return ~attention_mask(tokens)  # SDPA's convention: True = attend


def test_route_matches_default_dispatch_values_and_grads():
    q, k, v = _qkv()
    mask = _padded_mask(3, 20)
    grad_out = torch.randn(3, 6, 20, 8, generator=torch.Generator().manual_seed(1))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = sdpa_without_cudnn(q, k, v, mask, dropout_p=0.0, scale=0.3)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_layer_takes_the_route_when_unsafe(monkeypatch):
    cfg = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0)
    layer = SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                         attention_type="self")
    q, k, v = _qkv()
    to_layer = lambda t: t.permute(2, 0, 1, 3)  # [b, h, s, d] -> [s, b, h, d]  # noqa: E731
    mega_mask = ~_padded_mask(3, 20)  # Megatron's convention: True = masked out
    expected = layer(to_layer(q), to_layer(k), to_layer(v), mega_mask)
    calls = []
    real = attention.sdpa_without_cudnn

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "cudnn_backward_unsafe", lambda *a: True)
    monkeypatch.setattr(attention, "sdpa_without_cudnn", spy)
    routed = layer(to_layer(q), to_layer(k), to_layer(v), mega_mask)
    assert calls == [1]
    torch.testing.assert_close(routed, expected)
    g = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(routed, q, g)[0],
                               torch.autograd.grad(expected, q, g)[0])
