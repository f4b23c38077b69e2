"""Helpers for sharded-vs-unsharded tests: identical weights in any layout, full gradients back."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from hybridflow.parallel import param_rules as pr


def _seed_of(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)


def full_shape(name: str, local_shape, tp: int):
    shape = list(local_shape)
    dim = pr.split_dim(pr.param_rule(name))
    if dim is not None:
        shape[dim] *= tp
    return shape


def fill_deterministic(model, *, num_layers: int, std: float = 0.05) -> None:
    """Give every parameter the TP shard of a full tensor that depends only on its global name."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    for name, p in model.named_parameters():
        g = pr.global_name(name, pp_rank=pp_rank, num_layers=num_layers, pp_size=pp)
        gen = torch.Generator().manual_seed(_seed_of(g))
        full = torch.randn(full_shape(name, p.shape, tp), generator=gen) * std
        if "layernorm" in name:
            full = 1.0 + full
        with torch.no_grad():
            p.copy_(pr.shard_tensor(name, full, tp_rank=tp_rank, tp_size=tp))


def gather_full(named: dict, *, num_layers: int) -> dict:
    """Full tensors (global names) from this rank's TP/PP shards; returned on every rank."""
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    out = {}
    for name, t in named.items():
        t = t.detach().float().contiguous()
        if tp > 1 and pr.param_rule(name) != pr.REPLICATED:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=tp_group)
            t = pr.merge_shards(name, parts)
        out[pr.global_name(name, pp_rank=pp_rank, num_layers=num_layers, pp_size=pp)] = t
    if pp > 1:
        objs = [None] * pp
        dist.all_gather_object(objs, out, group=ps.get_pipeline_model_parallel_group())
        out = {k: v for d in objs for k, v in d.items()}
    return out
