"""Routing replay for mixture-of-experts RL (actor.router_replay=R3: Rollout Routing Replay).

The generator records, per token and MoE layer, the k experts its router chose (rollout/moe.py;
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
        recorded = t[:, :1] >= 0  # (n, 1)
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
