"""Sequence packing's compiled flex_attention on CUDA (hybridflow.models.attention.packed_attention):
forward and gradients equal SDPA run on each document alone, bf16, GQA, a length that is no
multiple of flex's 128 block."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from hybridflow.models.attention import document_causal_mask, packed_attention  # noqa: E402


def test_compiled_flex_equals_each_document_alone():
    lengths = [300, 17, 450, 1]
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)).cuda()
    s = doc.numel()
    torch.manual_seed(0)
    q = torch.randn(1, 8, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = packed_attention(q, k, v, document_causal_mask(doc), scale=0.125)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        qs, ks, vs = (t[:, :, sl].detach().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.125,
                                             enable_gqa=True)
        ref_grads = torch.autograd.grad(ref, (qs, ks, vs), dout[:, :, sl])
        torch.testing.assert_close(out[:, :, sl], ref, atol=2e-2, rtol=2e-2)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g[:, :, sl], rg, atol=2e-2, rtol=2e-2)
        start += n


def test_changing_lengths_do_not_recompile_each_call():
    """Token-budget micro-batches change their packed length every call: after the first shapes,
    new lengths must run without a fresh compile (dynamic shapes), or each micro-batch pays one."""
    import time

    torch._dynamo.utils.counters.clear()
    times = []
    for i, lengths in enumerate([[900, 700, 300], [1200, 40, 600, 33], [2000, 5],
                                 [640, 640, 641], [1500, 1500, 99]]):
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()
        s = doc.numel()
        q = torch.randn(1, 14, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, 2, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = packed_attention(q, k, v, document_causal_mask(doc), scale=0.125)
        out.sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    frames = dict(torch._dynamo.utils.counters["stats"])
    print(f"packed fwd+bwd seconds per call: {[round(t, 3) for t in times]}; dynamo {frames}")
    assert max(times[2:]) < 1.0, times  # a compile takes seconds
