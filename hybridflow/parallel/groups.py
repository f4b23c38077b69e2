"""Process groups: the one place that creates them.

`init_distributed()` starts torch.distributed from torchrun's environment (or as a 1-rank job when run
without torchrun), choosing NCCL when CUDA is present and gloo otherwise. `init_model_parallel()`
builds Megatron's TP/PP/DP groups (rank order tp-cp-ep-dp-pp: TP ranks are consecutive), the
generation layout's reshard groups, seeds the model-parallel RNG and returns the one
`ParallelContext` that every other module receives. On a machine without CUDA it first installs the
megatron CPU shims. Other modules receive groups as arguments; they never create them.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from hybridflow.parallel.context import ParallelContext, ReshardGroups
from hybridflow.parallel.layout import Layout


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(*, timeout_minutes: float = 30) -> None:
    """Initialise torch.distributed once: from torchrun's env, or as a single-rank job."""
    if dist.is_initialized():
        return
    # plain `python -m hybridflow.train`: a 1-rank world; also a second init in one process after
    # destroy() (the first set RANK and WORLD_SIZE=1 but no rendezvous address)
    single = "RANK" not in os.environ or (os.environ.get("WORLD_SIZE") == "1"
                                          and "MASTER_ADDR" not in os.environ)
    if single:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device_id = None
    if torch.cuda.is_available():
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device_id)
        backend = "nccl"
    else:
        if os.path.exists("/dev/nvidia0") or os.environ.get("CUDA_VISIBLE_DEVICES"):
            import warnings

            warnings.warn("a GPU seems present but torch.cuda.is_available() is False (driver, CUDA "
                          "build or CUDA_VISIBLE_DEVICES?): running on CPU over gloo")
        from hybridflow.parallel import _cpu_compat

        _cpu_compat.install()
        backend = "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if single:  # an in-memory store: no port to pick, so parallel 1-rank jobs cannot collide
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=device_id)
    else:  # device_id binds NCCL communicators to this rank's GPU up front (no device guessing)
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)


def init_model_parallel(*, tp: int, pp: int, seed: int, tp_gen: Optional[int] = None,
                        ep: int = 1, etp: Optional[int] = None,
                        timeout_minutes: float = 30) -> ParallelContext:
    """Build Megatron's parallel groups and the reshard groups of the gen layout (TP_g = `tp_gen`,
    default `tp`), seed every RNG (data, model-parallel, torch) and return the context.
    `ep` / `etp`: expert parallel / expert tensor parallel sizes of MoE layers (Megatron's; EP ranks
    are carved out of the DP x TP ranks of one stage, so EP x ETP must divide DP x TP; etp None:
    TP). timeout_minutes: how long a collective of any of these groups waits for a peer."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    layout = Layout(world_size=dist.get_world_size(), tp_t=tp, pp_t=pp, tp_g=tp_gen or tp)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp or tp,
                                 create_gloo_process_groups=False,
                                 distributed_timeout_minutes=timeout_minutes)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    # megatron-core still keeps its groups in globals; we take them once, here, as a collection
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    rank = dist.get_rank()
    c = layout.train_coord(rank)
    for axis, group, want in (("tp", pgs.tp, (tp, c.tp)), ("pp", pgs.pp, (pp, c.pp)),
                              ("dp", pgs.dp, (layout.dp_t, c.dp))):
        got = (dist.get_world_size(group), dist.get_rank(group))
        assert got == want, f"megatron's {axis} group (size, rank) {got} != the layout's {want}"
    reshard = (new_reshard_groups(layout, timeout_minutes=timeout_minutes)
               if layout.needs_reshard else None)
    return ParallelContext(layout=layout, rank=rank, pgs=pgs, reshard=reshard, device=device())


def new_subgroups(groups_of_ranks: list[list[int]], *, timeout_minutes: float = 30):
    """Create one process group per rank list (every rank must call this with the same lists);
    return the group this rank belongs to (None if it is in none)."""
    mine = None
    rank = dist.get_rank()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    for ranks in groups_of_ranks:
        g = dist.new_group(ranks=sorted(ranks), timeout=timeout)
        if rank in ranks:
            mine = g
    return mine


def destroy() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def new_reshard_groups(layout, *, timeout_minutes: float = 30) -> ReshardGroups:
    """Create the gen-layout groups of a `hybridflow.parallel.layout.Layout` (every rank calls this,
    once); lists of one rank make no group."""

    def make(lists):
        if not lists or len(lists[0]) == 1:
            return None
        return new_subgroups(lists, timeout_minutes=timeout_minutes)

    return ReshardGroups(micro_dp=make(layout.micro_dp_groups()),
                         pp=make(layout.pp_gather_groups()),
                         gen_tp=make(layout.gen_tp_groups()))
