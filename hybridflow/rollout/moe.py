"""The in-place generator's mixture-of-experts MLP (model.moe; rollout/decoder.py calls it).

Routing as transformers' Qwen3MoeSparseMoeBlock and megatron-core's softmax router: the router's
logits in fp32, softmax over all experts, the top_k largest, renormalised to sum to 1 when
`norm_topk_prob`; a token's output is the weighted sum of its experts' SwiGLU MLPs. The experts are
this generation TP rank's shards (fc1 = [gate_r; up_r], fc2's columns), so the result is a partial
sum that the caller all-reduces over TP_g, as the dense MLP's.

Two ways to compute it, the same result up to the order of the float sums:
- `sparse` (prefill, and decode without CUDA graphs): tokens grouped by expert, each active
  expert's two GEMMs over only its tokens. The group sizes are read on the host (one sync per
  layer), so it cannot be captured in a CUDA graph.
- `dense` (decode under CUDA-graph capture): every expert's GEMMs over every row, weighted by the
  routing weight (0 where the row did not pick it). No host sync, static shapes: capturable.
  Its cost is what decode costs anyway once rows x top_k >= experts (every expert's weights
  read once per step, which bounds a decode step); the extra FLOPs (experts / top_k times the
  routed ones) are cheap at decode batch sizes, where the GEMMs are bound by weight reads.
Both can write each row's chosen experts into a caller's buffer (`out`): the routing the training
passes replay (actor.router_replay=R3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.models.graphs import capturing


@dataclass
class MoEWeights:
    router: torch.Tensor  # (E, D), whole on every rank
    fc1: list  # E tensors (2 * F_e / TP_g, D): [gate_r; up_r]
    fc2: list  # E tensors (D, F_e / TP_g)
    top_k: int
    norm_topk_prob: bool

    def tensors(self) -> list:
        return [self.router, *self.fc1, *self.fc2]


def expert_names(layer_prefix: str, e: int) -> tuple[str, str]:
    """SequentialMLP's names of expert e's fc1 / fc2 (global expert index)."""
    q = f"{layer_prefix}mlp.experts.local_experts.{e}."
    return q + "linear_fc1.weight", q + "linear_fc2.weight"


def load_moe(cfg, params: dict, layer_prefix: str, *, tp: int, get, conv) -> MoEWeights:
    """The MoE weights of one layer from generation params (every expert, global names, this TP_g
    rank's shards); `get(params, name, shape)` checks, `conv` casts/moves."""
    m, D = cfg.moe, cfg.hidden_size
    fe = m.moe_ffn_hidden_size // tp
    fc1, fc2 = [], []
    for e in range(m.num_experts):
        n1, n2 = expert_names(layer_prefix, e)
        fc1.append(conv(get(params, n1, (2 * fe, D))))
        fc2.append(conv(get(params, n2, (D, fe))))
    router = conv(get(params, layer_prefix + "mlp.router.weight", (m.num_experts, D)))
    return MoEWeights(router=router, fc1=fc1, fc2=fc2, top_k=m.top_k,
                      norm_topk_prob=m.norm_topk_prob)


def route(h: torch.Tensor, m: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (n, k) fp32, experts (n, k) int64) of the rows h (n, D)."""
    probs = F.linear(h.float(), m.router.float()).softmax(-1)
    weights, experts = probs.topk(m.top_k, dim=-1)
    if m.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def _expert(h, fc1, fc2):
    gate, up = F.linear(h, fc1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2)


def _record(experts: torch.Tensor, out) -> None:
    if out is not None:  # (rows, k) int64 -> the caller's (..., k) buffer (int16)
        out.copy_(experts.view(out.shape))


def sparse(h: torch.Tensor, m: MoEWeights, out=None) -> torch.Tensor:
    weights, experts = route(h, m)
    _record(experts, out)
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    rows = torch.arange(n, device=h.device).repeat_interleave(k)[order]
    wts = weights.reshape(-1)[order]
    out = torch.zeros_like(h)
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=len(m.fc1)).tolist()):
        if count:
            r, wt = rows[start:start + count], wts[start:start + count]
            y = _expert(h.index_select(0, r), m.fc1[e], m.fc2[e])
            out.index_add_(0, r, y * wt[:, None].to(y.dtype))
            start += count
    return out


def dense(h: torch.Tensor, m: MoEWeights, out=None) -> torch.Tensor:
    weights, experts = route(h, m)
    _record(experts, out)
    gates = torch.zeros(h.shape[0], len(m.fc1), dtype=h.dtype, device=h.device)
    gates.scatter_(1, experts, weights.to(h.dtype))
    out = torch.zeros_like(h)
    for e in range(len(m.fc1)):
        out.addcmul_(_expert(h, m.fc1[e], m.fc2[e]), gates[:, e:e + 1])
    return out


def moe_mlp(h: torch.Tensor, m: MoEWeights, out=None) -> torch.Tensor:
    """This TP_g rank's partial MoE output for the normed rows h (n, D). `out`: a buffer of n x k
    elements that receives each row's chosen experts (actor.router_replay records them)."""
    return dense(h, m, out) if capturing() else sparse(h, m, out)
