"""Mixture-of-experts support around megatron-core's MoELayer (model.moe).

- `without_te_fix()`: megatron-core 0.16.1's router GEMM reads `te_general_gemm`, a name its
  moe_utils binds only when transformer-engine imports; without TE (CPU, or a GPU image without
  TE) the router fails with a NameError. Binding it to None selects Megatron's own torch path.
- `router_metrics(ctx, num_layers)`: what megatron-core's routers recorded during the last training
  pass (its layer-wise tracker: the load-balancing loss, the z-loss), summed over micro-batches,
  averaged over layers and DP ranks, as metrics; the tracker is cleared for the next pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def without_te_fix() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# megatron-core's tracker names -> our metric names (verl's / Megatron's spelling)
TRACKED = {"load_balancing_loss": "moe/load_balancing_loss", "z_loss": "moe/z_loss"}


def router_metrics(ctx, *, num_micro_batches: int) -> dict:
    """{metric: value} of the routers' losses in the last training pass (every rank calls it):
    each loss averaged over the model's MoE layers and micro-batches (summed over PP stages,
    averaged over DP). The tracker holds, per layer, the loss without its coefficient."""
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)

    tracker = get_moe_layer_wise_logging_tracker()
    out = {}
    for name, metric in TRACKED.items():
        entry = tracker.get(name)
        if entry is None:
            continue
        values = entry["values"].detach().float().clone()
        for group in (ctx.pp_group if ctx.pp_size > 1 else None,):
            if group is not None:
                dist.all_reduce(values, group=group)
        if ctx.dp_size > 1:
            dist.all_reduce(values, group=ctx.dp_group)
            values /= ctx.dp_size
        out[metric] = float(values.sum() / (len(values) * max(num_micro_batches, 1)))
    clear_aux_losses_tracker()
    return out


def routing_stats(probs_or_map: torch.Tensor, num_experts: int) -> dict:
    """Expert load of one routing map (tokens x experts, bool): the busiest expert's share of the
    routed tokens over the mean share (1.0 = perfectly balanced; num_experts / top_k = every token
    on the same experts)."""
    load = probs_or_map.float().sum(0)
    mean = load.sum() / num_experts
    return {"max_over_mean": float(load.max() / mean.clamp_min(1e-9))}
