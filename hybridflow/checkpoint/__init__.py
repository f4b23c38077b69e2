"""Checkpoints: Megatron dist_checkpointing for models and optimizers, plus trainer state; atomic.

Layout of a checkpoint root:
    <root>/latest                    text file: the step of the newest complete checkpoint
    <root>/step_<N>/
        <role>/                      one dist_checkpointing dir (torch_dist) per role: model tensors,
                                     optimizer tensors, optimizer step and LR-scheduler state
        model_config_<role>.json     the role's ModelConfig
        lora_config_<role>.json      LoRA settings of a role trained with adapters (actor.lora) and
                                     its base model's identity ("base": source and fingerprint,
                                     base.py); with "adapter_only" the role dir holds only the
                                     adapters (a critic: and its value head) and their
                                     optimizer state, not the frozen base
                                     (older checkpoints: base + adapter tensors, still loadable)
        trainer_state.json           the trainer's dict (its JSON-able values) and "step"
        trainer_state.pt             the trainer's other values (tensors, bytes), when there are any
        rng/rank_<r>.pt              RNG states of each rank (python, numpy, torch, cuda, megatron)
        meta.json                    layout at save time (world, TP, PP, DP), roles, format version
        tokenizer/                   optional copy of the tokenizer directory

Atomicity: every rank writes into `step_<N>.tmp/` (rank 0 first removes stale `*.tmp` dirs); when
all ranks are done rank 0 renames it to `step_<N>` (the one atomic step that publishes it) and then
rewrites `latest` through a temp file and `os.replace`. A `step_<N>` directory exists only when
complete, so the newest one is the truth: `latest_step` reads the directories, not `latest`, which a
crash between the rename and its rewrite leaves one step behind; `recover()` (at the start of a
run) rewrites a stale `latest` and removes what crashed saves left (`*.tmp`).

Failures: an I/O error on any rank during a save (disk full, quota, read-only, permission) is
shared with every rank (the all-gathers that replace the barriers), the partial `step_<N>.tmp` is
removed, and every rank raises the same OSError naming the errno, the path and the failing rank;
earlier steps and `latest` are untouched. Loading compares the saved ModelConfig of each role with
the requested one first and refuses any difference in shape (`allow_vocab_resize` lets only
`vocab_size` differ: rows are then copied up to the smaller vocabulary, new rows are zero).

Resharding: tensors are stored by global key and offset, so a checkpoint loads at any TP/PP/DP
(`optim.py` for the optimizer state, `full.py` for whole weights without a model). Vocabulary padding depends on TP; Megatron marks the
embedding and output layer `allow_shape_mismatch`, loading the common rows and zeroing the padding.
The RNG states are restored only when the layout is the one that saved them.
All ranks of the default group take part in save and load; the directory must be visible to all.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.utils import unwrap_model

from hybridflow.checkpoint import optim, state, unreadable
from hybridflow.checkpoint.base import adapter_only, check_base, read_lora_config
from hybridflow.checkpoint.failures import io_errors, raise_on_any_rank
from hybridflow.checkpoint.full import load_full_state_dict
from hybridflow.checkpoint.state import model_config_diff, read_model_config
from hybridflow.models.heads import VALUE_HEAD_PREFIX, ValueHead
from hybridflow.models.lora import is_adapter_name

__all__ = ["save_checkpoint", "load_checkpoint", "latest_step", "step_dir", "recover",
           "load_full_state_dict", "read_model_config", "model_config_diff"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root_dir: str, step: int) -> str:
    return os.path.join(root_dir, f"step_{step}")


def latest_step(root_dir: str) -> Optional[int]:
    """The step of the newest complete checkpoint under `root_dir`, or None. The `step_<N>`
    directories decide (each exists only when complete); `latest` may lag one step behind."""
    steps = _complete_steps(root_dir)
    return steps[-1] if steps else None


def recover(root_dir: str) -> Optional[int]:
    """Rank 0 at the start of a run: remove what crashed saves left (`*.tmp`), point a stale or
    missing `latest` at the newest complete step; return that step (None: no checkpoint)."""
    if not os.path.isdir(root_dir):
        return None
    for name in os.listdir(root_dir):
        if name.endswith(".tmp"):
            path = os.path.join(root_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return _repair_latest(root_dir)


def _repair_latest(root_dir: str) -> Optional[int]:
    step = latest_step(root_dir)
    if step is not None and _read_latest(root_dir) != step:
        _write_latest(root_dir, step)
    return step


def _read_latest(root_dir: str) -> Optional[int]:
    try:
        with open(os.path.join(root_dir, "latest"), encoding="utf-8") as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def _complete_steps(root_dir: str) -> list[int]:
    if not os.path.isdir(root_dir):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root_dir)
                  if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(root_dir, name)))


# ---------------------------------------------------------------------------------------- save
def save_checkpoint(root_dir: str, *, step: int, models: dict, optimizers: dict = {},
                    schedulers: dict = {}, trainer_state: dict = {}, model_configs: dict = {},
                    tokenizer_dir: Optional[str] = None, keep_last: Optional[int] = None,
                    layout=None, adapter_configs: dict = {}) -> str:
    """Write `<root_dir>/step_<step>` atomically on every rank; return its path.

    models: role -> list of model chunks (DDP-wrapped or bare); optimizers / schedulers: role ->
    Megatron optimizer / OptimizerParamScheduler; trainer_state: a dict (JSON-able values go to
    trainer_state.json, the rest to trainer_state.pt); keep_last: keep only the newest N steps;
    adapter_configs: role -> its LoRA settings (a dict, `lora_config_<role>.json`: what export
    needs to write a PEFT adapter); with `"adapter_only": True` (and the base's identity under
    "base", base.py) only the role's adapter tensors (and a critic's value head) are written, not
    its frozen base.
    An I/O error on any rank removes the partial directory and raises the same OSError on every
    rank (errno, path, failing rank); earlier steps and `latest` stay as they were."""
    for role in list(optimizers) + list(schedulers):
        if role not in models:
            raise ValueError(f"optimizer/scheduler for role {role!r} given without its model")
    state.sync_writer_shims()
    rank = dist.get_rank()
    final, tmp = step_dir(root_dir, step), step_dir(root_dir, step) + ".tmp"
    # A published step is never rewritten (the trainer's state at one step is one state): swapping
    # directories would open a window in which a crash loses the step that `latest` names.
    exists = [rank == 0 and os.path.isdir(final)]
    dist.broadcast_object_list(exists, src=0)
    if exists[0]:
        if rank == 0:
            _repair_latest(root_dir)  # a crash between its rename and `latest`
        return final
    what = f"saving checkpoint step {step}"
    with io_errors() as err:
        if rank == 0:
            os.makedirs(root_dir, exist_ok=True)
            for name in os.listdir(root_dir):  # leftovers of crashed saves
                if name.endswith(".tmp") and os.path.isdir(os.path.join(root_dir, name)):
                    shutil.rmtree(os.path.join(root_dir, name))
            for sub in [os.path.join(tmp, "rng")] + [os.path.join(tmp, r) for r in models]:
                os.makedirs(sub)
    raise_on_any_rank(err, what=what, cleanup=tmp)  # (the barrier before the writes)

    with io_errors() as err:
        for role, chunks in models.items():
            model_sd = _model_sharded_state_dict(chunks)
            if adapter_configs.get(role, {}).get("adapter_only"):
                model_sd = _adapters_only(model_sd)
            sd = {"model": model_sd}
            if role in optimizers:
                sd["optimizer"], _ = optim.sharded_state_dict(optimizers[role], model_sd)
            if role in schedulers:
                sd["scheduler"] = schedulers[role].state_dict()
            dist_checkpointing.save(sd, os.path.join(tmp, role))  # collective: fails on all ranks
        state.save_rng(tmp)
        if rank == 0:
            state.write_rank0_files(tmp, step=step, roles=list(models),
                                    trainer_state=trainer_state, model_configs=model_configs,
                                    tokenizer_dir=tokenizer_dir, layout=layout,
                                    adapter_configs=adapter_configs)
    raise_on_any_rank(err, what=what, cleanup=tmp)
    with io_errors() as err:
        if rank == 0:
            _publish(root_dir, tmp, final, step)
    raise_on_any_rank(err, what=what, cleanup=tmp)
    with io_errors() as err:
        if rank == 0 and keep_last:
            for old in _complete_steps(root_dir)[:-keep_last]:
                if old != step:  # rename first: a crash mid-delete leaves only a *.tmp leftover
                    doomed = step_dir(root_dir, old) + ".del.tmp"
                    os.rename(step_dir(root_dir, old), doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
    raise_on_any_rank(err, what=f"removing checkpoints older than step {step} (keep_last)")
    return final


def _publish(root_dir: str, tmp: str, final: str, step: int) -> None:
    """Rank 0: make the finished tmp dir the checkpoint of `step`, then point `latest` at it."""
    os.rename(tmp, final)
    _write_latest(root_dir, step)


def _write_latest(root_dir: str, step: int) -> None:
    latest_tmp = os.path.join(root_dir, "latest.tmp")
    with open(latest_tmp, "w", encoding="utf-8") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root_dir, "latest"))


# ---------------------------------------------------------------------------------------- load
def load_checkpoint(root_dir: str, *, models: dict, optimizers: dict = {}, schedulers: dict = {},
                    step: Optional[int] = None, load_optimizer: bool = True,
                    load_rng: bool = True, layout=None, model_configs: dict = {},
                    allow_vocab_resize: bool = False, base_identities: dict = {},
                    allow_base_change: bool = False) -> Optional[dict]:
    """Load a checkpoint into the given models (and optimizers, schedulers), in any layout.

    step=None loads the latest one and returns None when there is none. Returns the trainer state
    dict (with "step"). load_optimizer=False keeps the optimizers' fresh state (main weights are
    refreshed from the loaded model). RNG states come back only in the layout that saved them
    (`layout`, the current hybridflow.parallel.layout.Layout; None compares the world size only).
    model_configs: role -> the requested ModelConfig, compared with the saved one before anything
    loads (ValueError naming each differing key; `vocab_size` may differ with allow_vocab_resize).
    A role saved adapter-only (LoRA) loads only its adapters into the given model, whose base must
    already be built and loaded from its source: base_identities (role -> base.base_identity of
    that base) is compared with the saved one first (ValueError naming both unless
    allow_base_change; the warning line is printed by rank 0).
    Missing step/role dirs raise FileNotFoundError; shapes that do not match the checkpoint raise
    ValueError naming the tensor."""
    if step is None:
        step = latest_step(root_dir)
        if step is None:
            return None
    path = step_dir(root_dir, step)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist (steps under {root_dir}: "
                                f"{_complete_steps(root_dir)})")
    for role, cfg in model_configs.items():
        _check_model_config(path, role, cfg, allow_vocab_resize=allow_vocab_resize)
    only = {role for role in models if adapter_only(path, role)}
    for role in only:
        if role not in base_identities:
            raise ValueError(f"checkpoint {path} holds only the adapters of {role!r}: loading it "
                             "needs the identity of the base model they go on (base_identities)")
        line = check_base(read_lora_config(path, role).get("base", {}), base_identities[role],
                          checkpoint=path, role=role, allow_change=allow_base_change)
        if line and dist.get_rank() == 0:
            print(line, flush=True)
    for role, chunks in models.items():
        role_dir = os.path.join(path, role)
        if not os.path.isdir(role_dir):
            raise FileNotFoundError(f"checkpoint {path} has no role {role!r} (no {role_dir})")
        model_sd = _model_sharded_state_dict(chunks)
        if role in only:
            model_sd = _adapters_only(model_sd)
        request = {"model": model_sd}
        optimizer = optimizers.get(role) if load_optimizer else None
        if optimizer is not None:
            request["optimizer"], optimizer_sd = optim.sharded_state_dict(
                optimizer, model_sd, is_loading=True)
        _check_shapes(request, role_dir)
        with unreadable.named(path, role):
            loaded = dist_checkpointing.load(request, role_dir)
        for chunk, key in zip(_unwrap(chunks), _chunk_keys(chunks)):
            if role not in only:
                chunk.load_state_dict(loaded["model"][key], strict=True)
                continue
            missing, unexpected = chunk.load_state_dict(loaded["model"][key], strict=False)
            lost = [k for k in missing if _trained(k)]
            if lost or unexpected:
                raise ValueError(f"checkpoint {role_dir}: the model's adapters do not match the "
                                 f"saved ones (missing {lost[:3]}, unexpected {unexpected[:3]})")
        if optimizer is not None:
            optim.load(optimizer, optimizer_sd, loaded["optimizer"])
        elif role in optimizers:  # fresh optimizer state: main (fp32) weights from the model
            optimizers[role].reload_model_params()
        if role in schedulers and "scheduler" in loaded:
            try:
                schedulers[role].load_state_dict(loaded["scheduler"])
            except AssertionError as e:  # Megatron asserts that LR settings did not change
                raise ValueError(f"LR schedule of role {role!r} in {role_dir} does not match the "
                                 f"configured one: {e}") from None

    if load_rng:
        state.restore_rng(path, layout)
    return state.read_trainer_state(path)


def _check_model_config(path: str, role: str, requested, *, allow_vocab_resize: bool) -> None:
    if not os.path.exists(os.path.join(path, f"model_config_{role}.json")):
        return  # written by every save; absent only in hand-made checkpoints
    diff = model_config_diff(read_model_config(path, role), requested)
    if allow_vocab_resize:
        diff.pop("vocab_size", None)
    if not diff:
        return
    keys = "; ".join(f"{k}={saved!r} saved, {want!r} requested" for k, (saved, want) in diff.items())
    hint = (" (a deliberate vocabulary resize: trainer.resume_allow_vocab_resize=true)"
            if "vocab_size" in diff else "")
    raise ValueError(f"checkpoint {path} holds a different {role} model than the one requested: "
                     f"{keys}{hint}; resume the same model or start over (trainer.resume=false "
                     "or another trainer.output_dir)")


def _check_shapes(request: dict, role_dir: str) -> None:
    """ValueError naming the tensor when the model asks for what the checkpoint does not hold."""
    saved = dist_checkpointing.load_tensors_metadata(role_dir)
    for sh in _sharded_tensors(request):
        if sh.key not in saved:
            hint = (" (saved without optimizer state? load with load_optimizer=False)"
                    if sh.key.startswith("optimizer.") else "")
            raise ValueError(f"checkpoint {role_dir} has no tensor {sh.key!r}{hint}")
        want, have = tuple(sh.global_shape), tuple(saved[sh.key].global_shape)
        if sh.allow_shape_mismatch:  # padded vocabulary: only the vocab dim may differ
            want, have = want[:sh.prepend_axis_num] + want[sh.prepend_axis_num + 1:], \
                have[:sh.prepend_axis_num] + have[sh.prepend_axis_num + 1:]
        if want != have:
            raise ValueError(f"tensor {sh.key!r}: the model has global shape "
                             f"{tuple(sh.global_shape)}, checkpoint {role_dir} has "
                             f"{tuple(saved[sh.key].global_shape)}")


def _sharded_tensors(sd):
    for v in nested_values(sd):
        if isinstance(v, ShardedTensorFactory):
            yield from _sharded_tensors(v.build())
        elif isinstance(v, ShardedTensor):
            yield v


# ---------------------------------------------------------------------------------------- models
def _unwrap(chunks) -> list:
    return unwrap_model(list(chunks))


def _chunk_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _trained(name: str) -> bool:
    """What a LoRA role trains: its adapters, and a scalar role's value head (new, trained in
    full)."""
    return is_adapter_name(name) or name.startswith(VALUE_HEAD_PREFIX)


def _adapters_only(model_sd: dict) -> dict:
    """The trained entries (LoRA A and B factors, a critic's value head) of each chunk's sharded
    state dict."""
    return {key: {n: v for n, v in sd.items() if _trained(n)} for key, sd in model_sd.items()}


def _model_sharded_state_dict(chunks) -> dict:
    """Sharded state dicts of the bare GPTModels (no DDP `module.` prefix), one per chunk."""
    out = {}
    for chunk, key in zip(_unwrap(chunks), _chunk_keys(chunks)):
        head = getattr(chunk, "output_layer", None)
        if isinstance(head, ValueHead) and chunk.post_process:
            # LanguageModule marks `output_layer.weight` as vocab-padded; a value head has none.
            chunk.post_process = False
            try:
                out[key] = chunk.sharded_state_dict()
            finally:
                chunk.post_process = True
        else:
            out[key] = chunk.sharded_state_dict()
    return out
