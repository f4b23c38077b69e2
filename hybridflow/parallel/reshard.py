"""Reshard the actor from its training layout to its generation layout (3D-HybridEngine, our own).

`Resharder(model, layout=, groups=)` builds the plan once (`reshard_plan.py`: which piece of which
training shard goes where, per parameter rule); each step `gather()` returns the generation weights and
`release()` gives their memory back before the update phases. MoE models generate in place, their
experts gathered over EP by `generation_params` (at the end of this file).

gather(), per bucket (one flat buffer of `len(stages) x slot_numel` elements):
1. one `all_gather_into_tensor` per piece over the micro-DP group, issued as one coalesced group per
   bucket (one NCCL launch). The rank's own shard is written once, straight into its slot j of the
   region, never staged: pieces that are contiguous slices of the training parameter (vocab, column,
   the gate/up halves) are the collective's input and NCCL writes them into the slot (out of place);
   a row-parallel piece is copied transposed into its slot, which is then the input of an in-place
   all-gather (`inplace=True` does the same copy-then-in-place for every piece);
2. PP_t > 1: an in-place all-gather of the whole bucket over the PP group (decoder layers), or a
   broadcast from the owning stage (embedding, final norm, output layer).
All buckets are issued asynchronously (NCCL runs them on its stream, overlapped with the next bucket's
copies) and waited once. The result maps Megatron names of a PP=1 model holding ALL layers (global
layer indices) to this rank's TP_g shard, each a view into a bucket buffer (row-parallel weights are
transposed views, see reshard_plan.py) or, where the gen tensor equals the training tensor (replicated
norms at PP_t = 1; everything when TP_g == TP_t and PP_t == 1), the training parameter itself.
Memory: the buffers hold exactly the gen shard minus those aliases (plus <128 B alignment per
parameter); no scratch, no regroup copy. Training parameters are only read.

Host overhead: a 7B model has ~170 pieces, and building views and calling the collective wrappers per
piece every step cost milliseconds of Python (as long as the whole 1.5B gather on NVLink). So the
views (slots, inputs, the returned tensors) are built once; `release()` frees the memory by resizing
the buffers' storages to 0 bytes (the views stay, pointing at an empty storage) and `gather()` resizes
them back (the FSDP trick); each bucket's level-1 gather is one call of the process group's coalesced
all-gather with prebuilt tensor lists. The views are rebuilt if a training parameter's storage moved
(e.g. a DDP wrapper created after the Resharder).

Treat the returned tensors as read-only: some alias training parameters, all alias the buffers, and
after `release()` the buffer views have no memory (using them is an error). `pool=True` keeps the
memory between steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from hybridflow.parallel import param_rules as pr
from hybridflow.parallel.context import ReshardGroups
from hybridflow.parallel.layout import Layout
from hybridflow.parallel.reshard_plan import ParamMeta, Plan, build_plan

# torch >= 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _coalesced_all_gather(group, outputs: list, inputs: list):
    """One coalesced (one NCCL group launch) async all-gather of outputs[i] <- inputs[i]."""
    opts = AllgatherOptions()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    fn = getattr(group, "all_gather_single_coalesced", None) or group.allgather_into_tensor_coalesced
    return fn(outputs, inputs, opts)


@dataclass
class _Step:
    """One bucket, ready to run: tensors prebuilt over its buffer."""

    buf: torch.Tensor
    copies: list = field(default_factory=list)   # [(slot view, training view)]
    outputs: list = field(default_factory=list)  # level-1 all-gather regions
    inputs: list = field(default_factory=list)   # their inputs
    pp_input: Optional[torch.Tensor] = None      # in-place PP all-gather input (uniform buckets)
    pp_src: Optional[int] = None                 # broadcast source (ragged buckets)


class Resharder:
    """Train -> gen weights of `model` (this rank's PP stage): `gather() -> dict`, `release()`.

    bucket_mb: parameters per buffer/coalesced launch (1024: few enough buckets that their launches
    are negligible, small enough that copies overlap the previous bucket's gather; the speed is flat
    around it from 1.5B to 7B); pool: keep the memory between steps; coalesce=False: one async
    all-gather per piece (slower, for comparison); inplace: copy every own shard into its slot and
    all-gather in place (no faster; for comparison).
    """

    def __init__(self, model: torch.nn.Module, *, layout: Layout, groups: ReshardGroups,
                 bucket_mb: float = 1024.0, pool: bool = False, coalesce: bool = True,
                 inplace: bool = False):
        self.layout, self.groups, self.pool = layout, groups, pool
        self.coalesce, self.inplace = coalesce, inplace
        # LoRA adapters are not generation weights (they are merged into the base ones first)
        self._params = {n: p for n, p in model.named_parameters() if ".lora." not in n}
        rank = dist.get_rank()
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"reshard: layout world size {layout.world_size} != "
                             f"torch.distributed world size {dist.get_world_size()}")
        c = layout.train_coord(rank)
        self._stage, self._j = c.pp, c.tp % layout.micro_dp
        self._pp_ranks = [layout.train_rank(tp=c.tp, pp=s, dp=c.dp) for s in range(layout.pp_t)]
        for key, size in (("micro_dp", layout.micro_dp), ("pp", layout.pp_t)):
            group = getattr(groups, key)
            if (size > 1) != (group is not None) or (group and dist.get_world_size(group) != size):
                raise ValueError(f"reshard: groups.{key} does not match {layout}; build the groups "
                                 "with hybridflow.parallel.groups.new_reshard_groups(layout)")
        if groups.micro_dp is not None:
            assert dist.get_group_rank(groups.micro_dp, rank) == self._j
        if groups.pp is not None:
            assert dist.get_group_rank(groups.pp, rank) == self._stage
        metas = [ParamMeta(n, tuple(p.shape), p.dtype) for n, p in self._params.items()]
        stages = [metas]
        if layout.pp_t > 1:
            stages = [None] * layout.pp_t
            dist.all_gather_object(stages, metas, group=groups.pp)
        cfg = model.config
        dtype = next(iter(self._params.values())).dtype
        self.plan: Plan = build_plan(
            stages, layout=layout, num_layers=cfg.num_layers,
            num_query_groups=cfg.num_query_groups or cfg.num_attention_heads,
            tied=bool(getattr(model, "share_embeddings_and_output_weights", False)),
            bucket_numel=int(bucket_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
        self._device = next(iter(self._params.values())).device
        self._steps: list[_Step] | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._ptrs: list[int] = []
        self._allocated = False
        self._gathered = False

    def allocated_bytes(self) -> int:
        """Bytes of the gen buffers (allocated by gather(), freed by release() unless pooled)."""
        return sum(len(b.stages) * b.slot_numel * torch.empty((), dtype=b.dtype).element_size()
                   for b in self.plan.buckets)

    @torch.no_grad()
    def gather(self) -> dict[str, torch.Tensor]:
        if self._gathered:
            raise RuntimeError("Resharder.gather() called twice without release()")
        if self._steps is None or self._ptrs != [p.data_ptr() for p in self._params.values()]:
            self._prepare()
        elif not self._allocated:
            for step in self._steps:
                step.buf.untyped_storage().resize_(step.buf.numel() * step.buf.element_size())
        self._allocated = self._gathered = True
        works = []
        for step in self._steps:
            works += self._run(step)
        for w in works:  # on NCCL: the current stream waits, the host does not
            w.wait()
        return dict(self._views)

    def release(self) -> None:
        self._gathered = False
        if not self.pool and self._allocated:
            for step in self._steps:
                step.buf.untyped_storage().resize_(0)
            self._allocated = False

    # ----- built once -----
    def _source(self, piece) -> torch.Tensor:
        t = self._params[piece.param].detach()
        if piece.rows is not None:
            t = t[piece.rows[0]:piece.rows[1]]
        return t.t() if piece.transpose else t

    def _prepare(self) -> None:
        m = self.layout.micro_dp
        self._ptrs = [p.data_ptr() for p in self._params.values()]
        self._steps, views = [], {}
        for g, local in self.plan.aliases:
            views[g] = self._params[local].detach()
        for b in self.plan.buckets:
            step = _Step(buf=torch.empty(len(b.stages) * b.slot_numel, dtype=b.dtype,
                                         device=self._device))
            if self._stage in b.stages:
                slot = step.buf.narrow(0, b.stages.index(self._stage) * b.slot_numel, b.slot_numel)
                for p in b.pieces:
                    region = slot.narrow(0, p.offset, p.numel * (m if p.gathered else 1))
                    own = region.narrow(0, self._j * p.numel, p.numel) if p.gathered else region
                    src = self._source(p)
                    if p.gathered and not p.transpose and not self.inplace and src.is_contiguous():
                        own = src.reshape(-1)  # a view: NCCL writes it into its slot (out of place)
                    else:
                        step.copies.append((own.view(p.own_shape), src))
                    if p.gathered:
                        step.outputs.append(region)
                        step.inputs.append(own)
                if len(b.stages) > 1:
                    step.pp_input = slot
            if len(b.stages) == 1 and self.layout.pp_t > 1:
                step.pp_src = self._pp_ranks[b.stages[0]]
            for i, slot_views in enumerate(b.views):
                slot = step.buf.narrow(0, i * b.slot_numel, b.slot_numel)
                for v in slot_views:
                    t = slot.narrow(0, v.offset, v.numel).view(v.stored_shape)
                    views[v.name] = t.t() if v.transposed else t
            self._steps.append(step)
        self._views = {name: views[name] for name in self.plan.names}

    # ----- every step -----
    def _run(self, step: _Step) -> list:
        g = self.groups
        for dst, src in step.copies:
            dst.copy_(src)
        works = []
        if step.outputs and self.coalesce:
            works.append(_coalesced_all_gather(g.micro_dp, step.outputs, step.inputs))
        elif step.outputs:
            works += [_all_gather(o, i, group=g.micro_dp, async_op=True)
                      for o, i in zip(step.outputs, step.inputs)]
        if self.layout.pp_t == 1:
            return works
        for w in works:
            w.wait()
        if step.pp_src is not None:
            return [dist.broadcast(step.buf, src=step.pp_src, group=g.pp, async_op=True)]
        if step.pp_input is not None:  # a rank always owns its slot of a uniform bucket
            return [_all_gather(step.buf, step.pp_input, group=g.pp, async_op=True)]
        assert not works
        return []


# ----- MoE experts for in-place generation -----

def generation_params(params: dict, ctx, cfg) -> dict:
    """MoE expert weights for in-place generation: the training layout's EP / expert-TP shards to the
    generation layout's (every expert, each as this generation TP rank's shard).

    Training splits the experts over expert parallelism (EP rank r holds experts r*E/EP ..
    (r+1)*E/EP-1 as local experts 0..E/EP-1) and each expert over the expert TP group (ETP, by default
    the attention's TP). The in-place generator (TP_g = TP, PP = 1) runs every expert on each rank at
    TP_g's shards (rollout/moe.py), so `generation_params`:
    - renames the local experts to their global indices (no copy),
    - all-gathers the other EP ranks' experts (one all_gather_into_tensor per layer of the stacked
      local fc1 and fc2; the gathered tensors are new memory, held for the generation only),
    - at ETP = 1 under TP_g > 1 (whole experts per rank) takes this TP_g rank's shard of each expert
      (param_rules.shard_tensor: a view of fc2's columns, a copy of fc1's [gate_r; up_r] rows).
    ETP = TP_g needs no reslicing; other expert TP sizes are refused by the config checks.
    Cost per generation: (EP - 1) / EP of the expert weights received by every rank, over the EP group.

    `params` (this rank's named parameters, training layout, PP = 1) with every expert of every
    MoE layer under its global name, sliced for the generation TP."""
    coords = ctx.expert_coords
    ep, ep_rank = coords["ep_size"], coords["ep_rank"]
    etp = coords["etp_size"] or ctx.tp_size
    tp_g, tp_rank = ctx.tp_size, ctx.train.tp
    E = cfg.moe.num_experts
    out, local = {}, defaultdict(dict)  # (layer prefix, fc) -> {local expert: tensor}
    for name, t in params.items():
        j = pr.expert_index(name)
        if j is None:
            out[name] = t
            continue
        fc = "linear_fc1" if "linear_fc1" in name else "linear_fc2"
        local[(name.split("mlp.experts.")[0], fc)][j] = t
    for (prefix, fc), tensors in local.items():
        stacked = [tensors[j] for j in range(len(tensors))]
        if ep > 1:
            mine = torch.stack([t.detach() for t in stacked])
            full = mine.new_empty((ep * mine.shape[0], *mine.shape[1:]))
            dist.all_gather_into_tensor(full, mine, group=ctx.ep_group)
            del mine
            n = len(stacked)  # this rank's experts stay the training tensors themselves
            experts = [x for r in range(ep) for x in
                       (stacked if r == ep_rank else list(full[r * n:(r + 1) * n].unbind(0)))]
        else:
            experts = stacked
        for e, t in enumerate(experts):
            name = f"{prefix}mlp.experts.local_experts.{e}.{fc}.weight"
            if etp == 1 and tp_g > 1:
                t = pr.shard_tensor(name, t, tp_rank=tp_rank, tp_size=tp_g)
            out[name] = t
    assert all(f"{p}mlp.experts.local_experts.{E - 1}.linear_fc2.weight" in out
               for p, _ in local), "expert gather incomplete"
    return out
