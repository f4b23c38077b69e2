"""Optimizer state in one form that every Megatron optimizer reads, in any layout.

Megatron optimizers describe their state as ShardedTensors keyed by the model parameter they belong
to, `optimizer.state.<name>.<param key>`, with the parameter's global shape and sharding. The plain
fp32 optimizer has `exp_avg`, `exp_avg_sq`; the mixed-precision one adds the fp32 main weights as
`fp32_param`; the distributed optimizer, in its `fully_reshardable` format, gathers its flat DP
shards over DP at save (DP rank 0 writes them in model shape) and has `param`, `exp_avg`,
`exp_avg_sq`. (Its flat-per-rank `fully_sharded_model_space` format is refused by 0.16.1's own
ShardedTensor, and `dp_reshardable` cannot change TP/PP.) The non-tensor rest of their state dicts
(where the Adam step lives, param groups) differs in structure, so Megatron cannot load one
optimizer's checkpoint into another.

We store only those tensors, flat, with main weights always named `param` (and added for the plain
fp32 optimizer, whose main weights are the model weights), plus the Adam step (one scalar shared by
all parameters). Any optimizer then finds what it asks for: a run saved at TP=2 with the plain
optimizer resumes at TP=1 x DP=2 with the distributed one, and back; fp32 and bf16 alike. Learning
rate and weight decay come from the scheduler state and the config.
Loading: the optimizer builds its own sharded state dict (`is_loading=True`), its tensors are loaded
flat and put back into its structure, it loads that, and the step is set on every parameter's state.
Only Adam (what hybridflow builds) is handled; an fp16 loss-scaler state is not saved. Cost: the
distributed optimizer's save all-gathers its state over DP (3 fp32 copies of the TP/PP shard per
rank, transiently), and each rank reads the model-shaped state of its TP/PP shard at load.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedTensor,
                                                     ShardedTensorFactory)
from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                        make_sharded_optimizer_tensor)
from megatron.core.optimizer.optimizer import FP32Optimizer

_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
_MAIN = "optimizer.state.param."
_SHARDED = (ShardedTensor, ShardedTensorFactory)


def _parts(optimizer) -> list:
    """The per-dtype Megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if getattr(o, "optimizer", None) is not None]


def use_fused_adam(optimizer) -> None:
    """torch's Adam/AdamW (what Megatron builds without TE or apex, with torch's foreach default)
    as its fused kernels (`fused=True`): one pass over params, grads and moments instead of the
    foreach loops' several, each a full read and write of the optimizer state through HBM. CUDA
    parameters only. A checkpoint load brings back the saved param groups' flags and CPU step
    tensors, so the engine applies this before every step; each step tensor moves to its
    parameter's device once (fused Adam reads it there)."""
    for part in _parts(optimizer):
        opt = part.optimizer
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda for p in params):
            continue
        for g in opt.param_groups:
            g["fused"], g["foreach"] = True, False
        for p, st in opt.state.items():
            step = st.get("step")
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                st["step"] = step.to(device=p.device, dtype=torch.float32)


def _torch_adam(part) -> bool:
    """torch's Adam keeps a step per parameter state; fused Adams (TE, apex) in param groups."""
    return isinstance(part.optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _ensure_state(optimizer) -> None:
    """Adam state (zeros, step 0) for every parameter: before the first step there is none, and
    Megatron's sharded state dicts need it. Equivalent to a fresh Adam."""
    for part in _parts(optimizer):
        if part.init_state_fn is not None:
            part.init_state_fn(part.optimizer, part.config)
        if _torch_adam(part):
            for st in part.optimizer.state.values():
                if st and "step" not in st:
                    st["step"] = torch.tensor(0.0)


def adam_step(optimizer) -> int:
    steps = [int(st["step"]) for part in _parts(optimizer)
             for st in part.optimizer.state.values() if "step" in st]
    steps += [int(g["step"]) for part in _parts(optimizer)
              for g in part.optimizer.param_groups if "step" in g]
    return max(steps, default=0)


def _set_step(optimizer, step: int) -> None:
    """A fresh step tensor per parameter: Megatron's distributed optimizer loads one tensor shared
    by all parameters, which torch's foreach Adam would then increment once per parameter."""
    for part in _parts(optimizer):
        for st in part.optimizer.state.values() if _torch_adam(part) else ():
            old = st.get("step")
            if isinstance(old, torch.Tensor):
                st["step"] = torch.full_like(old, step)
            elif st:
                st["step"] = torch.tensor(float(step))
        for group in part.optimizer.param_groups:
            if "step" in group:
                group["step"] = step


def sharded_state_dict(optimizer, model_sd: dict, *, is_loading: bool = False):
    """(what goes into the checkpoint, the optimizer's own sharded state dict)."""
    _ensure_state(optimizer)
    own = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_METADATA)
    tensors = [_main_key(v) for v in nested_values(own) if isinstance(v, _SHARDED)]
    if not is_loading:
        for part in _parts(optimizer):
            if isinstance(part, FP32Optimizer):
                by_param = get_param_id_to_sharded_param_map(model_sd, part.get_parameters())
                tensors += [make_sharded_optimizer_tensor(sh, sh.data, prefix=_MAIN[:-1])
                            for sh in by_param.values()]
    return {"tensors": {str(i): t for i, t in enumerate(tensors)},
            "step": adam_step(optimizer)}, own


def _main_key(sh):
    """The mixed-precision optimizer names its fp32 main weights `fp32_param`; the distributed one
    `param`: store (and ask for) them under one name."""
    prefix = "optimizer.state.fp32_param."
    return replace(sh, key=_MAIN + sh.key[len(prefix):]) if sh.key.startswith(prefix) else sh


def load(optimizer, own: dict, loaded: dict) -> None:
    """Put the loaded tensors back into the optimizer's own structure and load it."""
    flat = iter(loaded["tensors"][str(i)] for i in range(len(loaded["tensors"])))

    def restore(v):
        if isinstance(v, _SHARDED):
            return next(flat)
        return v.unwrap() if isinstance(v, LocalNonpersistentObject) else v

    dict_list_map_inplace(restore, own)
    step = int(loaded["step"])
    parts = _parts(optimizer)
    _put_step(own, step, per_param=all(_torch_adam(p) for p in parts))
    for part, sd in zip(parts, [own] if len(parts) == 1 else [own[i] for i in range(len(parts))]):
        _load_part(part, sd)
    _set_step(optimizer, step)


def _load_part(part, sd: dict) -> None:
    if sd.get("param_state_sharding_type") != "fully_reshardable":
        part.load_state_dict(sd)
        return
    # 0.16.1 with torch's Adam: the loader copies every state entry, "step" included, from the
    # checkpoint tensors, which never hold "step" (KeyError). Load groups and step first, then
    # the parameter state with "step" set aside.
    param_state = sd.pop("param_state")
    sd.pop("param_state_sharding_type")
    part.load_state_dict(sd)
    steps = {p: st.pop("step") for p, st in part.optimizer.state.items() if "step" in st}
    try:
        part.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            part.optimizer.state[p]["step"] = step


def _put_step(x, step: int, *, per_param: bool) -> None:
    """The step where each optimizer's own structure keeps it: per-parameter torch Adam state
    (plain and mixed-precision optimizers) or param groups (distributed optimizer, fused Adams)."""
    if isinstance(x, dict):
        if "exp_avg" in x:
            if per_param:
                x["step"] = torch.tensor(float(step))
        elif "step" in x and "lr" in x:
            x["step"] = step
        for v in x.values():
            _put_step(v, step, per_param=per_param)
    elif isinstance(x, list):
        for v in x:
            _put_step(v, step, per_param=per_param)
