"""Sequence packing's kernels on CUDA (hybridflow.models.attention): compiled flex_attention
(`packed_attention`) and torch's varlen_attn (`varlen_packed_attention`, algo.packed_attention):
forward and gradients equal SDPA run on each document alone, bf16, GQA (Qwen2.5-0.5B's 14 query /
2 KV heads, head_dim 64), documents of length 1 and off the 128 grid; and a packed micro-batch
through the real Engine (forward log-probs, one update's gradients) gives the same results on both.

Tolerance (bf16 inputs, fp32 accumulation in every kernel): against fp32 SDPA on each document
alone, max |error| <= 2% of the reference's max |value| per tensor (output, dQ, dK, dV); the Engine's
log-probs within 5e-2 (absolute; they are ~ -7), each gradient within 3% of its norm."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from hybridflow.models.attention import (  # noqa: E402
    SDPAttention, choose_packed_attention, document_causal_mask, fa4_unsupported,
    packed_attention, packed_documents)


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


LENGTHS = [300, 1, 17, 450, 128, 1, 77, 200]  # 1174 tokens; 1s, off and on the 128 grid
HQ, HKV, HD = 14, 2, 64


def _documents(kernel: str):
    lengths = torch.tensor(LENGTHS)
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS)), lengths).cuda()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32).cuda()
    return packed_documents(doc, cu, max(LENGTHS), kernel=kernel)


def _layer():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=HQ * HD, num_attention_heads=HQ,
                            num_query_groups=HKV, kv_channels=HD, attention_dropout=0.0,
                            bf16=True)
    return SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                        attention_type="self").cuda()


def _within(got: torch.Tensor, ref: torch.Tensor, rel: float, what: str) -> float:
    err = float((got.float() - ref).abs().max() / ref.abs().max())
    assert err <= rel, f"{what}: max |error| {err:.4f} of max |reference| (allowed {rel})"
    return err


def test_varlen_and_flex_equal_each_document_alone():
    """SDPAttention's packed branch on every kernel (fa4 where flash-attn-4 runs), Megatron's
    layout: q/k/v are [s, 1, h, d] views into one fused projection (as Megatron splits its
    linear_qkv), not contiguous tensors."""
    kernel, line = choose_packed_attention("auto", device=torch.device("cuda"),
                                           dtype=torch.bfloat16, head_dim=HD)
    assert kernel == "varlen", line  # torch 2.10+ on an sm80+ GPU
    s = sum(LENGTHS)
    torch.manual_seed(0)
    mixed = torch.randn(s, 1, HQ + 2 * HKV, HD, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
    dout = torch.randn(s, 1, HQ * HD, device="cuda", dtype=torch.bfloat16)
    layer = _layer()
    results = {}
    # FlashAttention-4 (algo.packed_attention=fa4) where flash-attn-4 is installed on an sm_90+ GPU
    fa4 = fa4_unsupported(torch.device("cuda"), torch.bfloat16, HD) is None
    for kernel in ("varlen", "flex") + (("fa4",) if fa4 else ()):
        mixed.grad = None
        q, k, v = mixed[:, :, :HQ], mixed[:, :, HQ:HQ + HKV], mixed[:, :, HQ + HKV:]
        out = layer(q, k, v, _documents(kernel))
        out.backward(dout)
        results[kernel] = (out.detach(), mixed.grad.clone())
    # the reference: fp32 SDPA on each document alone, the same (bf16-rounded) inputs
    x = mixed.detach().float().requires_grad_()
    q, k, v = (t.permute(1, 2, 0, 3) for t in (x[:, :, :HQ], x[:, :, HQ:HQ + HKV],
                                               x[:, :, HQ + HKV:]))
    outs, start = [], 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                                   is_causal=True, scale=HD ** -0.5,
                                                   enable_gqa=True))
        start += n
    ref = torch.cat(outs, 2).permute(2, 0, 1, 3).reshape(s, 1, HQ * HD)
    ref.backward(dout.float())
    errors = {}
    for kernel, (out, grad) in results.items():
        errors[kernel] = [_within(out, ref.detach(), 2e-2, f"{kernel} output")]
        for name, sl in (("dq", slice(0, HQ)), ("dk", slice(HQ, HQ + HKV)),
                         ("dv", slice(HQ + HKV, None))):
            errors[kernel].append(_within(grad[:, :, sl], x.grad[:, :, sl], 2e-2,
                                          f"{kernel} {name}"))
    print("max |error| / max |ref| (out, dq, dk, dv):", errors)


def test_engine_packed_micro_batch_varlen_equals_flex(single_rank_ctx):
    """One packed ref pass and one update through the Engine (bf16, a 2-layer model of
    Qwen2.5-0.5B's attention shape) on varlen and on flex, from the same weights."""
    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
    from hybridflow.data.batch import RolloutBatch
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    model = ModelConfig(num_layers=2, hidden_size=HQ * HD, ffn_hidden_size=1024,
                        num_attention_heads=HQ, num_query_groups=HKV, vocab_size=1000,
                        add_qkv_bias=True, attention_backend="sdpa")
    prompts, responses = [40, 97, 3, 130, 61, 12], [300, 1, 129, 250, 1, 64]
    b, p, r = len(prompts), max(prompts), max(responses)
    g = torch.Generator().manual_seed(0)
    prompt_mask = (torch.arange(p)[None] >= p - torch.tensor(prompts)[:, None]).long()
    response_mask = (torch.arange(r)[None] < torch.tensor(responses)[:, None]).long()
    batch = RolloutBatch(
        prompt_ids=torch.randint(1, 1000, (b, p), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(1, 1000, (b, r), generator=g) * response_mask,
        response_mask=response_mask, group_ids=torch.arange(b) // 2, indices=torch.arange(b),
        old_logprobs=-6.9 + 0.1 * torch.randn(b, r, generator=g),
        ref_logprobs=-6.9 + 0.1 * torch.randn(b, r, generator=g),
        advantages=torch.randn(b, 1, generator=g) * response_mask).to("cuda")
    algo = AlgoConfig(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    loss_fn = actor_objective(algo, num_tokens=int(batch.response_mask.sum()), num_seqs=b)
    kw = dict(micro_batch_size=b, max_tokens=4096, pack=True)  # one packed micro-batch
    res = {}
    # varlen and flex in bf16, and flex in fp32 as the reference both are held to: two bf16
    # kernels that sum in different orders differ by bf16 rounding (up to ~0.06 in a log-prob here),
    # so varlen must be as close to the fp32 result as flex is, not bit-close to flex
    fa4 = fa4_unsupported(torch.device("cuda"), torch.bfloat16, HD) is None
    for kernel, precision in (("varlen", "bf16"), ("flex", "bf16"), ("flex", "fp32")) + (
            (("fa4", "bf16"),) if fa4 else ()):
        eng = Engine(role="actor", model_cfg=model, ctx=single_rank_ctx, precision=precision,
                     parallel=ParallelConfig(use_distributed_optimizer=False),
                     optim=OptimConfig(lr=1e-4, clip_grad=0.0), total_updates=1,
                     packed_attention=kernel)
        fill_deterministic(eng.module, num_layers=model.num_layers)
        eng.optimizer.reload_model_params()
        micro, _ = eng._micro_batches(batch, **kw)
        assert len(micro) == 1 and micro[0][2] is not None  # one packed row
        lp = eng.compute_logprobs(batch, temperature=1.0, **kw)
        m = eng.train_step(batch, loss_fn, need_entropy=True, **kw)
        assert eng.packed_kernel() == kernel
        res[kernel, precision] = (lp.float(), m, {n: q.main_grad.float().clone()
                                                  for n, q in eng.module.named_parameters()})
        del eng
    (lp_v, m_v, g_v), (lp_f, m_f, g_f) = res["varlen", "bf16"], res["flex", "bf16"]
    lp_r, m_r, g_r = res["flex", "fp32"]
    mask = batch.response_mask.bool().to(lp_v.device)  # the log-probs come back on the host
    err = {k: float((res[k][0] - lp_r)[mask].abs().max()) for k in (("varlen", "bf16"),
                                                                     ("flex", "bf16"))}
    assert err["varlen", "bf16"] <= 1.5 * err["flex", "bf16"] + 1e-2, err
    lp_diff = float((lp_v - lp_f)[mask].abs().max())
    assert lp_diff <= 0.15, lp_diff
    assert (lp_v[~mask] == 0).all()

    def rel(g):
        return {n: float((g[n] - g_r[n]).norm() / g_r[n].norm().clamp(min=1e-12)) for n in g_r}

    if fa4:  # held to what varlen reaches against the fp32 reference
        lp_4, _, g_4 = res["fa4", "bf16"]
        err4 = float((lp_4 - lp_r)[mask].abs().max())
        assert err4 <= 1.5 * err["varlen", "bf16"] + 1e-2, (err4, err)
        rel_4, rel_vr = rel(g_4), rel(g_v)
        worst4 = max(rel_4, key=lambda n: rel_4[n] - 1.5 * rel_vr[n])
        assert rel_4[worst4] <= 1.5 * rel_vr[worst4] + 1e-2, (worst4, rel_4[worst4])
    rel_v, rel_f = rel(g_v), rel(g_f)
    worst = max(rel_v, key=lambda n: rel_v[n] - 1.5 * rel_f[n])
    assert rel_v[worst] <= 1.5 * rel_f[worst] + 1e-2, (worst, rel_v[worst], rel_f[worst])
    grad_diffs = {n: float((g_v[n] - g_f[n]).norm() / g_f[n].norm().clamp(min=1e-12))
                  for n in g_f}
    for key in ("actor/pg_loss", "actor/kl_loss"):
        if key in m_r:
            for m in (m_v, m_f):
                assert abs(m[key] - m_r[key]) <= 2e-2 * max(1.0, abs(m_r[key])), (key, m, m_r)
    worst_vf = max(grad_diffs, key=grad_diffs.get)
    print(f"log-probs max |error| vs fp32: varlen {err['varlen', 'bf16']:.4f}, flex "
          f"{err['flex', 'bf16']:.4f}; varlen vs flex {lp_diff:.4f}; worst gradient vs fp32 "
          f"{worst}: varlen {rel_v[worst]:.4f}, flex {rel_f[worst]:.4f}; varlen vs flex "
          f"{worst_vf} {grad_diffs[worst_vf]:.4f} of its norm")
