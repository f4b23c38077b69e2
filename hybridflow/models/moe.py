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

Routing replay (actor.router_replay=R3: Rollout Routing Replay; `Replay`, `router_order`,
`bind_for_recompute`): the generator records, per token and MoE layer, the k experts its router chose (rollout/moe.py;
RolloutBatch.prompt_experts / response_experts). The actor's training passes of that step (the
old-log-prob pass and the update's forward) then send every recorded token to those experts, so
the training forward computes the experts the sampled tokens were generated with: the router
mismatch between generation and training (bf16 vs fp32, other kernels, a changed policy in later
mini-batches) no longer changes which experts run.

What is replayed, precisely: only the choice of experts. The gating weights are computed from the
training router's current logits over the replayed experts, as megatron-core's router would over
its own choice (Qwen3-MoE, norm_topk_prob: the softmax over the k replayed logits; without it, the
softmax over all experts gathered at the replayed ones), so the router keeps its gradient through
the weights of the experts it is made to use (as R3 does). Tokens without a record (-1: padding,
a response's last token, which generation never fed back) take the router's own top-k. The
load-balancing and z losses still see the router's own choice (megatron-core computes them from
the logits apart from the routing).

How: megatron-core 0.16.1's TopKRouter asks `router.router_replay.get_replay_topk(...)` for its
top-k when that attribute is set (its moe_enable_routing_replay). Its own RouterReplay class keeps
every router of the process in one class-level list (actor and reference alike), replays one target
per router with no fallback for unrecorded tokens and needs its action switched for recomputation
in backward; `Replay` below installs a small object of ours in that slot instead, per model, and
binds each micro-batch's targets around its forward (`bound`). Under activation checkpointing
(models/build.checkpoint_layers) a layer's recomputation in backward re-binds the targets its
forward had (`bind_for_recompute`), whatever the pipeline schedule ran in between.

Token order: a router sees its layer's input (S_local, b, D) flattened, token s * b + j; under
sequence parallelism S_local is this TP rank's slice of the sequence. `router_order` lays the
recorded (b, S, L, k) ids out the same way; packed micro-batches carry ids that follow their
tokens (data/packing.py). Expert parallelism changes nothing here: the router runs on its own rank's
tokens before they are dispatched.

Metrics (every training pass with targets, all-reduced over the world): `recorded` (token, layer)
pairs and the `mismatched` ones, whose router's own top-k set differs from the replayed one: the
share of routing decisions replay changed (0 when generation and training route alike).
"""

from __future__ import annotations

import contextlib
from typing import Optional

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

class _RouterHook:
    """Sits in a TopKRouter's `router_replay` slot: its top-k, replaced by `target` where recorded."""

    def __init__(self, layer: int):
        self.layer = layer  # global, 0-based
        self.target: Optional[torch.Tensor] = None  # (tokens, k) int64; -1 rows: own choice
        self.count = True  # recomputation in backward does not count again
        self.mismatched = self.recorded = None  # () int64 tensors, on the device

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        t = self.target
        if t is None:
            return probs, own
        if t.shape != own.shape:
            raise ValueError(f"router replay of layer {self.layer}: {tuple(t.shape)} recorded "
                             f"experts for {tuple(own.shape)} routed ones (tokens, top_k)")
        # a token replays when all its k ids are experts: the ids index `scores` (a GPU gather
        # asserts on one out of range), so a -1 anywhere (nothing recorded) takes the own choice
        recorded = ((t >= 0) & (t < scores.shape[-1])).all(1, keepdim=True)  # (n, 1)
        idx = torch.where(recorded, t, own)
        if self.count:
            differ = (own.sort(1).values != t.sort(1).values).any(1) & recorded[:, 0]
            n, m = recorded.sum(), differ.sum()
            self.recorded = n if self.recorded is None else self.recorded + n
            self.mismatched = m if self.mismatched is None else self.mismatched + m
        return scores.gather(1, idx), idx


class Replay:
    """The router hooks of one model (this rank's pipeline stage)."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.hooks = []
        for m in model.modules():
            if isinstance(m, TopKRouter):
                m.router_replay = _RouterHook(m.layer_number - 1)
                self.hooks.append(m.router_replay)

    @contextlib.contextmanager
    def bound(self, experts: Optional[torch.Tensor]):
        """Route by `experts` (tokens, L, k) in the routers' order (`router_order`) inside; None:
        the routers' own choice."""
        if experts is not None:
            for h in self.hooks:
                h.target = experts[:, h.layer].long()
        try:
            yield
        finally:
            for h in self.hooks:
                h.target = None

    def counts(self) -> tuple[float, float]:
        """(mismatched, recorded) (token, layer) pairs since the last call, summed over the world
        (every rank calls it); resets them."""
        dev = next((h.recorded.device for h in self.hooks if h.recorded is not None), None)
        t = torch.zeros(2, dtype=torch.float64,
                        device=dev if dev is not None else _device())
        for h in self.hooks:
            if h.recorded is not None:
                t += torch.stack([h.mismatched, h.recorded]).to(t)
            h.mismatched = h.recorded = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return float(t[0]), float(t[1])

    def metrics(self, name: str) -> dict:
        """{name: the mismatched share} of the passes since the last call (empty without any
        recorded token anywhere)."""
        mismatched, recorded = self.counts()
        return {name: mismatched / recorded} if recorded else {}


def _device():
    from hybridflow.parallel.groups import device

    return device()


def router_order(experts: torch.Tensor, *, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """(b, S, L, k) ids per row and column -> (S_local * b, L, k) in the routers' token order
    (`sp_size` > 1: this rank's sequence slice, as sequence parallelism splits it)."""
    t = experts.transpose(0, 1)  # (S, b, L, k)
    if sp_size > 1:
        n = t.shape[0] // sp_size
        t = t[sp_rank * n:(sp_rank + 1) * n]
    return t.reshape(-1, *t.shape[2:])


def bind_for_recompute(layer, fn):
    """`fn` (the layer's forward) as checkpointing should call it: with the layer's router targets
    as bound now, at the forward, also when backward recomputes it later (other micro-batches may
    have been bound in between under a pipeline schedule), counted once. A layer without a replay
    hook: `fn` itself."""
    hook = getattr(getattr(getattr(layer, "mlp", None), "router", None), "router_replay", None)
    if not isinstance(hook, _RouterHook):
        return fn
    target, calls = hook.target, [0]

    def run(*args, **kwargs):
        saved, count = hook.target, hook.count
        hook.target, hook.count = target, calls[0] == 0
        calls[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            hook.target, hook.count = saved, count

    return run
