"""parallel.elementwise_kernels=liger on CUDA (models/fused.py): liger-kernel's RMSNorm and SwiGLU
against torch's RMSNorm and Megatron's compiled SwiGLU, op by op (bf16, the shapes of
Qwen2.5-0.5B: hidden 896, intermediate 4,864) and through one packed ref pass and update of the
Engine. Tolerances: per op, liger within 1.5x torch's own bf16 error against an fp32 reference
(+ one bf16 step); the Engine's log-probs and gradients against the same model in fp32 within 1.5x
of what torch's kernels reach."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("liger_kernel")

from hybridflow.models.fused import _LigerSwiGLU, _MEGATRON_SWIGLU, liger_rms_norm  # noqa: E402


def _err(x, ref):
    return float((x.float() - ref).abs().max())


def test_liger_rms_norm_matches_torch_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(4099, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(896, device="cuda")).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(4099, 896, device="cuda", dtype=torch.bfloat16)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.rms_norm(xf, (896,), wf, 1e-6)
    ref_dx, ref_dw = torch.autograd.grad(ref, (xf, wf), dy.float())
    outs = {}
    for name, fn in (("torch", lambda: F.rms_norm(x, (896,), w, 1e-6)),
                     ("liger", lambda: liger_rms_norm(x, w, 1e-6))):
        y = fn()
        outs[name] = (y, *torch.autograd.grad(y, (x, w), dy))
    for i, ref_i in enumerate((ref, ref_dx, ref_dw)):
        e_t, e_l = _err(outs["torch"][i], ref_i), _err(outs["liger"][i], ref_i)
        step = float(ref_i.abs().max()) * 2 ** -8
        assert e_l <= 1.5 * e_t + step, (i, e_l, e_t)
    assert outs["liger"][2].dtype == w.dtype and outs["liger"][0].dtype == x.dtype


def test_liger_swiglu_matches_megatron_on_fc1_layout():
    torch.manual_seed(1)
    y = torch.randn(2048, 1, 2 * 4864, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(2048, 1, 4864, device="cuda", dtype=torch.bfloat16)
    yf = y.detach().float().requires_grad_()
    a, b = yf.chunk(2, -1)
    ref = F.silu(a) * b
    (ref_dy,) = torch.autograd.grad(ref, yf, dc.float())
    res = {}
    for name, fn in (("megatron", _MEGATRON_SWIGLU), ("liger", _LigerSwiGLU)):
        out = fn.apply(y.view(-1, y.shape[-1]), False, False).view(2048, 1, -1)
        res[name] = (out, *torch.autograd.grad(out, y, dc))
    for i, ref_i in enumerate((ref, ref_dy)):
        e_m, e_l = _err(res["megatron"][i], ref_i), _err(res["liger"][i], ref_i)
        assert e_l <= 1.5 * e_m + float(ref_i.abs().max()) * 2 ** -8, (i, e_l, e_m)
    assert y.detach().isfinite().all()  # the saved fc1 output is not overwritten (in_place off)
    torch.testing.assert_close(y.detach().float(), yf.detach())


def test_engine_update_with_liger_kernels_matches_torch_kernels(single_rank_ctx):
    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
    from hybridflow.data.batch import RolloutBatch
    from hybridflow.engine import Engine
    from hybridflow.models.build import LigerRMSNorm, TorchRMSNorm
    from tests.dist.parity_util import fill_deterministic

    model = ModelConfig(num_layers=2, hidden_size=896, ffn_hidden_size=4864,
                        num_attention_heads=14, num_query_groups=2, vocab_size=1000,
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
        advantages=torch.randn(b, 1, generator=g) * response_mask)
    algo = AlgoConfig(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.1)
    loss_fn = actor_objective(algo, num_tokens=int(batch.response_mask.sum()), num_seqs=b)
    kw = dict(micro_batch_size=b, max_tokens=4096, pack=True)
    res = {}
    for kernels, precision in (("torch", "bf16"), ("liger", "bf16"), ("torch", "fp32")):
        eng = Engine(role="actor", model_cfg=model, ctx=single_rank_ctx, precision=precision,
                     parallel=ParallelConfig(use_distributed_optimizer=False,
                                             elementwise_kernels=kernels),
                     optim=OptimConfig(lr=1e-4, clip_grad=0.0), total_updates=1,
                     packed_attention="varlen" if precision == "bf16" else "flex")
        norms = {type(m) for m in eng.module.modules() if isinstance(m, TorchRMSNorm)}
        assert norms == {LigerRMSNorm if kernels == "liger" else TorchRMSNorm}, norms
        fill_deterministic(eng.module, num_layers=model.num_layers)
        eng.optimizer.reload_model_params()
        lp = eng.compute_logprobs(batch, temperature=1.0, **kw)
        m = eng.train_step(batch, loss_fn, need_entropy=True, **kw)
        res[kernels, precision] = (lp.float(), m, {n: q.main_grad.float().clone()
                                                   for n, q in eng.module.named_parameters()})
        del eng
    (lp_t, _, g_t), (lp_l, m_l, g_l) = res["torch", "bf16"], res["liger", "bf16"]
    lp_r, m_r, g_r = res["torch", "fp32"]
    mask = batch.response_mask.bool()
    e_t, e_l = (float((x - lp_r)[mask].abs().max()) for x in (lp_t, lp_l))
    assert e_l <= 1.5 * e_t + 1e-2, (e_l, e_t)

    def rel(gr):
        return {n: float((gr[n] - g_r[n]).norm() / g_r[n].norm().clamp(min=1e-12)) for n in g_r}

    rel_t, rel_l = rel(g_t), rel(g_l)
    worst = max(rel_l, key=lambda n: rel_l[n] - 1.5 * rel_t[n])
    assert rel_l[worst] <= 1.5 * rel_t[worst] + 1e-2, (worst, rel_l[worst], rel_t[worst])
    for key in ("actor/pg_loss", "actor/kl_loss"):
        if key in m_r:
            assert abs(m_l[key] - m_r[key]) <= 2e-2 * max(1.0, abs(m_r[key])), (key, m_l, m_r)
    print(f"log-probs max |error| vs fp32: liger {e_l:.4f}, torch {e_t:.4f}; worst gradient "
          f"{worst}: liger {rel_l[worst]:.4f}, torch {rel_t[worst]:.4f} of its norm")
