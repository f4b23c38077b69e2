"""Mixture-of-experts support around megatron-core's MoELayer (model.moe).

- `without_te_fix()`: megatron-core 0.16.1's router GEMM reads `te_general_gemm`, a name its
  moe_utils binds only when transformer-engine imports; without TE (CPU, or a GPU image without
  TE) the router fails with a NameError. Binding it to None selects Megatron's own torch path.
- `router_metrics(ctx, num_micro_batches=)`: what megatron-core's routers recorded during the last
  training pass (its layer-wise tracker: the load-balancing loss, the z-loss), averaged over
  layers, micro-batches and DP ranks, as metrics; the tracker is cleared for the next pass.
- `RouterStats`: forward hooks on the routers counting, per layer, the tokens each expert got in
  training passes; `metrics()` gives the expert load balance (the busiest expert's load over the
  mean, per layer: averaged and worst) and the share of token-expert assignments dropped (0 while
  no capacity factor is set: megatron-core then drops nothing; computed, not assumed).
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


class RouterStats:
    """Expert loads of the training passes of one model (its routers' routing maps)."""

    def __init__(self, model, *, num_layers: int, num_experts: int, top_k: int, device):
        from megatron.core.transformer.moe.router import TopKRouter

        self.top_k = top_k
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(num_layers, dtype=torch.float64, device=device)
        for m in model.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if module.training:
            layer = module.layer_number - 1  # global, 1-based (PP stages hold their own)
            routing_map = out[1]  # (tokens, experts) bool
            self.load[layer] += routing_map.sum(0).to(self.load.dtype)
            self.tokens[layer] += routing_map.shape[0]

    def metrics(self) -> dict:
        """Every rank calls it (one all-reduce over the world); resets the counts. Token copies
        (TP ranks without SP see the same tokens) scale a layer's counts alike: the ratios hold."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            both = torch.cat([self.load, self.tokens[:, None]], 1)
            dist.all_reduce(both)
            self.load, self.tokens = both[:, :-1].contiguous(), both[:, -1].contiguous()
        seen = self.tokens > 0
        out = {}
        if seen.any():
            load, tokens = self.load[seen], self.tokens[seen]
            ratio = load.max(1).values / (load.sum(1) / load.shape[1]).clamp_min(1e-9)
            out = {"moe/load_max_over_mean": float(ratio.mean()),
                   "moe/load_max_over_mean_worst_layer": float(ratio.max()),
                   "moe/dropped_token_frac": float(1 - load.sum() / (tokens.sum() * self.top_k))}
        self.load.zero_()
        self.tokens.zero_()
        return out
