"""Fused vocab-parallel log-probs under TP=2 (gloo; the kernels' PyTorch twin on CPU): log-probs,
entropy and each rank's logits-shard gradient equal an unsharded torch.log_softmax computation,
with a padded vocabulary whose padding sits on the last rank."""

import torch
import torch.distributed as dist

from tests.dist.launcher import run_ranks

B, T, V_TRUE, V_PAD, TEMP = 2, 5, 27, 32, 0.8


def _data():
    g = torch.Generator().manual_seed(0)
    full = 3 * torch.randn(B, T, V_PAD, generator=g)
    targets = torch.randint(0, V_TRUE, (B, T), generator=g)
    targets[0, :3] = torch.tensor([0, 15, 26])  # first/last ids of each shard's real range
    return full, targets, torch.randn(2, B, T, generator=g)


def _rank_fn(impl):
    from hybridflow.models.logprob import vocab_parallel_logprobs

    full, targets, w = _data()
    rank, world = dist.get_rank(), dist.get_world_size()
    v = V_PAD // world
    shard = full[..., rank * v:(rank + 1) * v].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(shard, targets, tp_group=dist.group.WORLD,
                                      true_vocab_size=V_TRUE, temperature=TEMP,
                                      with_entropy=True, impl=impl)
    ((w[0] * lp).sum() + (w[1] * ent).sum()).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "grad": shard.grad}


def test_fused_tp2_matches_unsharded():
    full, targets, w = _data()
    x = full.clone().requires_grad_()
    logp = torch.log_softmax(x[..., :V_TRUE] / TEMP, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((w[0] * lp).sum() + (w[1] * ent).sum()).backward()
    res = run_ranks(_rank_fn, 2, "triton")
    for r in res:
        torch.testing.assert_close(r["lp"], lp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["ent"], ent.detach(), rtol=1e-5, atol=1e-5)
    grad = torch.cat([r["grad"] for r in res], dim=-1)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)
