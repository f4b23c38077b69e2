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
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from hybridflow.parallel import param_rules as pr


def generation_params(params: dict, ctx, cfg) -> dict:
    """`params` (this rank's named parameters, training layout, PP = 1) with every expert of every
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
            full = mine.new_empty((ep, *mine.shape))
            dist.all_gather_into_tensor(full, mine, group=ctx.ep_group)
            full[ep_rank] = mine
            experts = [x for r in range(ep) for x in
                       (stacked if r == ep_rank else list(full[r].unbind(0)))]
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
