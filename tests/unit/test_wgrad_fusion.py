"""parallel.gradient_accumulation_fusion: the decoder layers' linears add their weight gradients into
DDP's main_grad in their backward (models/linear.py), and the Engine's update is the one DDP's hooks
give, with tied embeddings (the output layer stays unfused, so the embedding's own gradient still
reaches main_grad) and over several micro-batches. The CUDA path (one mixed-dtype GEMM) is checked in
tests/gpu/test_wgrad_fusion_gpu.py."""

import pytest
import torch

from hybridflow.algo.objectives import actor_objective
from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.models import linear

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, add_qkv_bias=True, tie_word_embeddings=True)
B, P, R, MICRO = 4, 5, 6, 2


@pytest.fixture(scope="module")
def ctx(single_rank_ctx):
    return single_rank_ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_wgrad(dtype):
    g = torch.Generator().manual_seed(0)
    main = torch.randn(7, 5, generator=g)
    grad, x = torch.randn(9, 7, generator=g).to(dtype), torch.randn(9, 5, generator=g).to(dtype)
    want = main + grad.float().t() @ x.float()
    linear.accumulate_wgrad(main, grad, x)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(main, want, rtol=tol, atol=tol)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ones = torch.ones(B, P, dtype=torch.long)
    return RolloutBatch(prompt_ids=torch.randint(1, 50, (B, P), generator=g), prompt_mask=ones,
                        response_ids=torch.randint(1, 50, (B, R), generator=g),
                        response_mask=torch.ones(B, R, dtype=torch.long),
                        group_ids=torch.arange(B) // 2, indices=torch.arange(B),
                        old_logprobs=torch.full((B, R), -3.9),
                        advantages=torch.randn(B, 1, generator=g))


def _steps(ctx, precision: str, fused: bool, monkeypatch):
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    calls = []
    real = linear.accumulate_wgrad
    monkeypatch.setattr(linear, "accumulate_wgrad", lambda *a: (calls.append(1), real(*a)))
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, precision=precision,
                 parallel=ParallelConfig(gradient_accumulation_fusion=fused),
                 optim=OptimConfig(lr=1e-3), total_updates=2)
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
    eng.optimizer.reload_model_params()
    names = {p: n for n, p in eng.module.named_parameters()}
    hooked = []  # parameters given a gradient by autograd (for DDP's hook to add into main_grad)
    for p in eng.module.parameters():  # (the hooks run for the fused weights too, with none)
        p.register_post_accumulate_grad_hook(
            lambda q: hooked.append(names[q]) if q.grad is not None else None)
    metrics = []
    for seed in (0, 1):
        loss_fn = actor_objective(AlgoConfig(), num_tokens=B * R, num_seqs=B)
        metrics.append(eng.train_step(_batch(seed), loss_fn, micro_batch_size=MICRO))
    weights = {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}
    return metrics, weights, len(calls), set(hooked)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_update_matches_ddp_hooks(ctx, precision, monkeypatch):
    m_ref, w_ref, n_ref, hooked_ref = _steps(ctx, precision, False, monkeypatch)
    m, w, n, hooked = _steps(ctx, precision, True, monkeypatch)
    # 4 linears per layer, 2 micro-batches per step, 2 steps; none without the option
    assert (n_ref, n) == (0, 4 * MODEL.num_layers * 2 * 2)
    fused = {name for name in w if ".layers." in name and name.endswith(".weight")
             and "layernorm" not in name}
    assert fused and not fused & hooked and fused <= hooked_ref
    # the tied embedding / output weight and the biases still go through autograd and the hook
    assert "embedding.word_embeddings.weight" in hooked and hooked == hooked_ref - fused
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=0, atol=0)
    for step, (a, b) in enumerate(zip(m, m_ref)):
        assert a["grad_norm"] > 0
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=tol["rtol"], abs=tol["atol"]), (step, key)
    for name in w_ref:
        torch.testing.assert_close(w[name], w_ref[name], **tol, msg=name)
