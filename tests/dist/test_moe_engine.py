"""A Qwen3-MoE-shaped actor trained through the Engine (Megatron forward_backward_func, DDP with
its expert buffers, Megatron's optimizer, the load-balancing loss on) at EP=2 (DP=2: each rank half
the rows and half the experts) gives the 1-rank run's loss, load-balancing loss, grad norm and
weights after one Adam step (fp32)."""

import pytest
import torch

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig
from hybridflow.model_config import MoEConfig
from hybridflow.parallel import groups
from hybridflow.parallel import param_rules as pr
from tests.dist.launcher import run_ranks
from tests.dist.parity_util import _seed_of
from tests.dist.test_parallel_parity import _global_batch

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50, qk_layernorm=True, kv_channels=16,
                    moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16,
                                  aux_loss_coeff=0.01))


def _worker(ep: int):
    import torch.distributed as dist

    from hybridflow.algo import get_policy_loss
    from hybridflow.engine import Engine

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3, ep=ep)
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx,
                 parallel=ParallelConfig(expert_parallel_size=ep, use_distributed_optimizer=False),
                 precision="fp32", optim=OptimConfig(lr=1e-3, clip_grad=0.0), total_updates=1)
    coords = ctx.expert_coords
    kw = dict(ep_rank=coords["ep_rank"], num_experts=4, ep_size=coords["ep_size"])
    with torch.no_grad():  # weights that depend only on the global name
        for name, p in eng.module.named_parameters():
            g = torch.Generator().manual_seed(_seed_of(pr.global_expert_name(name, **kw)))
            full = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + full if "layernorm" in name else full)
    eng.optimizer.reload_model_params()
    batch = _global_batch()
    num_tokens = int(batch.response_mask.sum())
    dp, rank = ctx.dp_size, ctx.train.dp
    local = batch.select(slice(rank * batch.batch_size // dp, (rank + 1) * batch.batch_size // dp))
    pg = get_policy_loss("vanilla")

    def loss_fn(out, mb):
        loss, m = pg(logprobs=out["logprobs"], old_logprobs=mb.old_logprobs,
                     advantages=mb.advantages, response_mask=mb.response_mask,
                     num_tokens=num_tokens)
        return loss, {"pg_loss": loss}

    metrics = eng.train_step(local, loss_fn, micro_batch_size=2)
    weights = {}
    for name, p in eng.module.named_parameters():
        weights[pr.global_expert_name(name, **kw)] = p.detach().clone()
    if ep > 1:
        objs = [None] * ep
        dist.all_gather_object(objs, weights, group=ctx.ep_group)
        weights = {k: v for d in objs for k, v in d.items()}
    return {k: v for k, v in metrics.items() if not isinstance(v, torch.Tensor)}, weights


def test_ep2_matches_single_rank():
    ref_metrics, ref_w = run_ranks(_worker, 1, 1)[0]
    assert ref_metrics["moe/load_balancing_loss"] > 0 and ref_metrics["grad_norm"] > 0
    for metrics, weights in run_ranks(_worker, 2, 2):
        for key in ("pg_loss", "grad_norm", "moe/load_balancing_loss", "moe/load_max_over_mean"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6), key
        assert weights.keys() == ref_w.keys()
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_w[name], atol=1e-6, rtol=1e-5, msg=name)
