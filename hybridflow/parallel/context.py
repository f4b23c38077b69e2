"""`ParallelContext`: everything a rank knows about parallelism, built once at start-up.

It holds megatron-core's `ProcessGroupCollection` (tp, pp, dp, mp, ...), the actor's training and
generation `Layout` (pure rank arithmetic, hybridflow.parallel.layout) and the groups of the train ->
gen reshard. It is passed explicitly to the engines, the rollout stage, the DP helpers and
checkpointing; no other module reads Megatron's `parallel_state` getters. Coordinates (TP/PP/DP rank,
gen replica) come from the layout; hybridflow.parallel.groups builds the context and checks the
layout against the groups Megatron built, so the two can never disagree silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hybridflow.parallel.layout import Layout, TrainCoord


@dataclass(frozen=True)
class ReshardGroups:
    """This rank's groups for the train -> gen reshard and for generation (None: a 1-rank group)."""

    micro_dp: Optional[dist.ProcessGroup]  # gathers the m training shards of one gen shard
    pp: Optional[dist.ProcessGroup]        # gathers the stages' layers when PP_t > 1
    gen_tp: Optional[dist.ProcessGroup]    # the generation TP group


@dataclass(frozen=True)
class ParallelContext:
    layout: Layout
    rank: int
    pgs: object  # megatron.core.process_groups_config.ProcessGroupCollection
    reshard: Optional[ReshardGroups]  # None when generation uses the training layout as it is
    device: torch.device

    # ----- training layout -----
    @property
    def train(self) -> TrainCoord:
        return self.layout.train_coord(self.rank)

    @property
    def tp_size(self) -> int:
        return self.layout.tp_t

    @property
    def pp_size(self) -> int:
        return self.layout.pp_t

    @property
    def dp_size(self) -> int:
        return self.layout.dp_t

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.pgs.tp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pgs.pp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.pgs.dp

    @property
    def mp_group(self) -> dist.ProcessGroup:
        """The TP_t x PP_t ranks of one DP replica."""
        return self.pgs.mp

    @property
    def ep_size(self) -> int:
        """Expert parallel size (1 without MoE); Megatron's `ep` group."""
        return dist.get_world_size(self.pgs.ep) if getattr(self.pgs, "ep", None) else 1

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        return getattr(self.pgs, "ep", None)

    @property
    def expert_coords(self) -> dict:
        """ep_rank, ep_size, etp_rank, etp_size of this rank (the HF loader's keywords)."""
        out = {"ep_rank": 0, "ep_size": 1, "etp_rank": None, "etp_size": None}
        if getattr(self.pgs, "ep", None) is not None:
            out.update(ep_rank=dist.get_rank(self.pgs.ep), ep_size=dist.get_world_size(self.pgs.ep))
        if getattr(self.pgs, "expt_tp", None) is not None:
            out.update(etp_rank=dist.get_rank(self.pgs.expt_tp),
                       etp_size=dist.get_world_size(self.pgs.expt_tp))
        return out

    @property
    def is_pp_last_stage(self) -> bool:
        return self.train.pp == self.layout.pp_t - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        c = self.train
        return self.layout.train_rank(tp=c.tp, pp=self.layout.pp_t - 1, dp=c.dp)

    # ----- generation layout -----
    @property
    def gen_tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.pgs.tp if self.reshard is None else self.reshard.gen_tp

    @property
    def gen_replica(self) -> int:
        """Index of this rank's gen replica among those of its training model-parallel group."""
        return self.layout.replica_in_model_parallel_group(self.rank)

    @property
    def num_gen_replicas(self) -> int:
        return self.layout.replicas_per_model_parallel_group

