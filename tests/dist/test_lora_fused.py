"""LoRA's fused linears through the real Engine (one rank, fp32): an actor with
parallel.gradient_accumulation_fusion (the default: `LoRAAdapter.fused_linear`, the factors'
gradients added into DDP's main_grad, the GEMM matrices made once per pass) against one without it
(the autograd path: `.grad` and DDP's hooks), and one with fusion and activation recompute, from
the same weights and adapters, over two token-budget updates (several micro-batches each, so the
once-per-pass matrices serve more than one): the same loss, gradients, updated adapters and,
after each update, log-probs (a stale matrix from before the optimizer step would show there)."""

import torch

from hybridflow.config import LoRAConfig, OptimConfig, ParallelConfig
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks
from tests.dist.parity_util import fill_deterministic
from tests.dist.test_dynamic_bsz import BUDGET, MODEL, _batch
from tests.dist.test_lora import _loss_fn

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["all-linear"])


def _worker():
    from hybridflow.engine import Engine
    from hybridflow.models.lora import adapters

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3)
    batch = _batch()
    out = {}
    for name, fused, recompute in (("fused", True, False), ("autograd", False, False),
                                   ("fused_recompute", True, True)):
        par = ParallelConfig(gradient_accumulation_fusion=fused,
                             activation_checkpointing=recompute)
        eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=par, precision="fp32",
                     optim=OptimConfig(lr=1e-2, clip_grad=0.0), lora=LORA)
        fill_deterministic(eng.module, num_layers=MODEL.num_layers)
        eng.optimizer.reload_model_params()
        res = {"paths": {ad.fusable(lin, lin.weight, None) for lin, ad in adapters(eng.module)}}
        loss_fn = _loss_fn(int(batch.response_mask.sum()))
        micro, _ = eng._micro_batches(batch, micro_batch_size=2, max_tokens=BUDGET)
        res["micro_batches"] = len(micro)
        for step in range(2):
            m = eng.train_step(batch, loss_fn, micro_batch_size=2, max_tokens=BUDGET)
            trained = {n: p for n, p in eng.module.named_parameters() if p.requires_grad}
            res[f"loss{step}"] = m["pg_loss"]
            res[f"grads{step}"] = {n: p.main_grad.clone() for n, p in trained.items()}
            res[f"params{step}"] = {n: p.detach().clone() for n, p in trained.items()}
            res[f"logprobs{step}"] = eng.compute_logprobs(batch, micro_batch_size=2,
                                                          max_tokens=BUDGET)
        out[name] = res
    return out


def test_fused_lora_update_matches_autograd_path():
    res = run_ranks(_worker, 1)[0]
    ref = res["autograd"]
    assert ref["paths"] == {False} and res["fused"]["micro_batches"] > 1
    for fused in (res["fused"], res["fused_recompute"]):  # also recomputed in backward
        assert fused["paths"] == {True}
        _assert_same(fused, ref)
    # the second update moved the adapters again: its log-probs are not the first's
    assert (ref["logprobs1"] - ref["logprobs0"]).abs().max() > 1e-4


def _assert_same(fused: dict, ref: dict) -> None:
    for step in range(2):
        assert abs(fused[f"loss{step}"] - ref[f"loss{step}"]) < 1e-6
        for key in ("grads", "params"):
            a, b = fused[f"{key}{step}"], ref[f"{key}{step}"]
            assert a.keys() == b.keys() and len(a) == MODEL.num_layers * 7 * 2
            for n in a:
                torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=f"{key}{step} {n}")
        torch.testing.assert_close(fused[f"logprobs{step}"], ref[f"logprobs{step}"], rtol=1e-5,
                                   atol=1e-5)
