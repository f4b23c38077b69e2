"""Loss aggregation under micro-batching, gradient accumulation and DP: DP=2 ranks, two micro-batches
each, with the global normalisers, give the gradient of ONE rank running the whole mini-batch as one
micro-batch with the plain (local) normalisers. For every loss_agg_mode, for GSPO / GSPO-token, and
for the vanilla loss with TIS weights, through the real Engine (Megatron forward_backward_func + DDP)
and the real actor objective (policy loss + entropy bonus + KL loss)."""

import dataclasses

import pytest
import torch

from hybridflow.algo import entropy_loss, get_policy_loss, kl_loss, tis_weights
from hybridflow.algo.objectives import actor_objective
from hybridflow.config import AlgoConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel import groups
from hybridflow.parallel.dp import dp_sum
from tests.dist.launcher import run_ranks
from tests.dist.parity_util import fill_deterministic, gather_full

MODEL = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)
C = 6.0  # loss_scale_factor of seq-mean-token-sum-norm: the max response length
BASE = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.1,
            clip_ratio_low=0.2, clip_ratio_high=0.28)
CASES = {
    "token-mean": AlgoConfig(loss_agg_mode="token-mean", **BASE),
    "seq-mean-token-sum": AlgoConfig(loss_agg_mode="seq-mean-token-sum", **BASE),
    "seq-mean-token-mean": AlgoConfig(loss_agg_mode="seq-mean-token-mean", **BASE),
    "seq-mean-token-sum-norm": AlgoConfig(loss_agg_mode="seq-mean-token-sum-norm", **BASE),
    "gspo": AlgoConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", **BASE),
    "gspo_token": AlgoConfig(policy_loss="gspo_token", loss_agg_mode="seq-mean-token-mean", **BASE),
    "tis": AlgoConfig(loss_agg_mode="token-mean", tis_imp_ratio_cap=1.05, **BASE),
}


def _global_batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    b, p, r = 8, 3, 6
    lengths = torch.tensor([6, 1, 5, 2, 3, 6, 1, 4])  # uneven over rows, micro-batches and ranks
    mask = (torch.arange(r)[None] < lengths[:, None]).long()
    old = -3.9 + 0.1 * torch.randn(b, r, generator=g)
    return RolloutBatch(
        prompt_ids=torch.randint(0, 50, (b, p), generator=g), prompt_mask=torch.ones(b, p).long(),
        response_ids=torch.randint(0, 50, (b, r), generator=g) * mask, response_mask=mask,
        group_ids=torch.arange(b) // 2, indices=torch.arange(b), old_logprobs=old,
        rollout_logprobs=old + 0.1 * torch.randn(b, r, generator=g),
        ref_logprobs=-3.9 + 0.1 * torch.randn(b, r, generator=g),
        advantages=torch.randn(b, 1, generator=g) * mask)  # outcome advantages: one per row


def _reference_loss(cfg: AlgoConfig):
    """The whole mini-batch in one micro-batch, the losses' own (local) normalisers."""

    def loss_fn(out, mb):
        mask = mb.response_mask
        w = None
        if cfg.tis_imp_ratio_cap is not None:
            w = tis_weights(old_logprobs=mb.old_logprobs, rollout_logprobs=mb.rollout_logprobs,
                            cap=cfg.tis_imp_ratio_cap)
        pg, _ = get_policy_loss(cfg.policy_loss)(
            logprobs=out["logprobs"], old_logprobs=mb.old_logprobs, advantages=mb.advantages,
            response_mask=mask, clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high, agg_mode=cfg.loss_agg_mode, loss_scale_factor=C,
            rollout_is_weights=w)
        ent = entropy_loss(out["entropy"], mask, cfg.loss_agg_mode, loss_scale_factor=C)
        kl = kl_loss(out["logprobs"], mb.ref_logprobs, mask, cfg.kl_loss_type, cfg.loss_agg_mode,
                     loss_scale_factor=C)
        loss = pg - cfg.entropy_coeff * ent + cfg.kl_loss_coef * kl
        return loss, {"loss": loss}

    return loss_fn


def _worker(dp_expected: int):
    from hybridflow.engine import Engine

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3)
    assert ctx.dp_size == dp_expected
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx,
                 parallel=ParallelConfig(use_distributed_optimizer=False), precision="fp32",
                 optim=OptimConfig(lr=1e-3, clip_grad=0.0), total_updates=10)
    batch = _global_batch()
    dp, rank = ctx.dp_size, ctx.train.dp
    local = batch.select(slice(rank * batch.batch_size // dp, (rank + 1) * batch.batch_size // dp))
    out = {}
    for name, cfg in CASES.items():
        fill_deterministic(eng.module, num_layers=MODEL.num_layers)
        if dp == 1:
            loss_fn, mbs = _reference_loss(cfg), batch.batch_size
        else:  # the trainer's normalisers: sums over this mini-batch on all DP ranks
            num_tokens = int(dp_sum(float(local.response_mask.sum()), group=ctx.dp_group))
            num_seqs = int(dp_sum(float(local.response_mask.any(1).sum()), group=ctx.dp_group))
            loss_fn = actor_objective(cfg, num_tokens=num_tokens, num_seqs=num_seqs,
                                      loss_scale_factor=C)
            mbs = 2
        eng.train_step(local, loss_fn, micro_batch_size=mbs, need_entropy=True)
        grads = {n: p.main_grad.clone() for n, p in eng.module.named_parameters()}
        out[name] = gather_full(grads, num_layers=MODEL.num_layers)
    return out


def test_dp2_micro_batches_match_one_rank_whole_batch():
    ref = run_ranks(_worker, 1, 1)[0]
    results = run_ranks(_worker, 2, 2)
    for name in CASES:
        norms = [g.norm() for g in ref[name].values()]
        assert sum(norms) > 0, name
        for res in results:
            for p, g in res[name].items():
                torch.testing.assert_close(g, ref[name][p], atol=1e-6, rtol=1e-4,
                                           msg=f"{name}: {p}")
    # the modes do differ (the test would not notice a mode being ignored otherwise)
    p = next(iter(ref["token-mean"]))
    assert not torch.allclose(ref["token-mean"][p], ref["seq-mean-token-mean"][p])
    assert not torch.allclose(ref["token-mean"][p], ref["tis"][p])
