"""The small files of a checkpoint step (trainer state, configs, RNG, layout) and writer fixes.

`trainer_state.json` holds the trainer's JSON-able values and the step; values JSON cannot hold
(tensors, bytes, numpy arrays) go to `trainer_state.pt`. RNG states are per rank (`rng/rank_<r>.pt`:
python, numpy, torch, cuda and Megatron's model-parallel tracker) and only mean something in the
layout that saved them, which `meta.json` records.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import queue
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from hybridflow.config import ModelConfig

FORMAT_VERSION = 1


def sync_writer_shims() -> None:
    """Two fixes to torch_dist's file writer (megatron-core 0.16.1) for synchronous saves:
    its forked writers log their memory through psutil and, without it, die before reporting,
    which hangs the save (the number only feeds a debug line); and it returns results through a
    queue served by a spawned multiprocessing Manager (seconds to start, once per process) that
    only asynchronous saves need: ours run in this process, where a plain queue does."""
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def write_rank0_files(tmp: str, *, step: int, roles: list, trainer_state: dict,
                      model_configs: dict, tokenizer_dir: Optional[str], layout=None,
                      adapter_configs: Optional[dict] = None) -> None:
    state, extra = {}, {}
    for key, value in trainer_state.items():
        try:
            json.dumps(value)
            state[key] = value
        except (TypeError, ValueError):
            extra[key] = value
    state["step"] = step
    write_json(os.path.join(tmp, "trainer_state.json"), state)
    if extra:
        save_torch(extra, os.path.join(tmp, "trainer_state.pt"))
    for role, cfg in model_configs.items():
        write_json(os.path.join(tmp, f"model_config_{role}.json"), dataclasses.asdict(cfg))
    for role, lora in (adapter_configs or {}).items():
        write_json(os.path.join(tmp, f"lora_config_{role}.json"), lora)
    write_json(os.path.join(tmp, "meta.json"), {
        "format_version": FORMAT_VERSION, "step": step, "roles": roles, **layout_record(layout)})
    if tokenizer_dir is not None:
        if not os.path.isdir(tokenizer_dir):
            raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} is not a directory")
        from hybridflow.models.hf_save import copy_tokenizer_files

        copy_tokenizer_files(tokenizer_dir, os.path.join(tmp, "tokenizer"))  # not the weights


def read_trainer_state(path: str) -> dict:
    state = read_json(os.path.join(path, "trainer_state.json"))
    extra = os.path.join(path, "trainer_state.pt")
    if os.path.exists(extra):
        from hybridflow.checkpoint.unreadable import named_file

        with named_file(extra):
            state.update(torch.load(extra, weights_only=False))
    return state


def read_model_config(step_path: str, role: str = "actor") -> ModelConfig:
    """The ModelConfig saved with `role` in the checkpoint dir `step_path` (unknown keys, from a
    newer hybridflow, are ignored)."""
    data = read_json(os.path.join(step_path, f"model_config_{role}.json"))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in data.items() if k in fields})


# ModelConfig fields that are not the model: where it came from, how attention is computed, and
# the longest position RoPE is asked for (no weight depends on it; a resume may raise it)
_NOT_ARCHITECTURE = ("name", "hf_path", "gguf_path", "hf_architecture", "attention_backend",
                     "max_position_embeddings")


def model_config_diff(saved: ModelConfig, requested: ModelConfig) -> dict:
    """{key: (saved, requested)} for every architecture field that differs (shape, vocabulary,
    heads, query groups, head dim, tied embeddings, norm and RoPE settings, biases)."""
    out = {}
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(saved, f.name), getattr(requested, f.name)
        if f.name == "kv_channels":  # None means hidden_size // num_attention_heads
            a = a or saved.hidden_size // saved.num_attention_heads
            b = b or requested.hidden_size // requested.num_attention_heads
        if f.name not in _NOT_ARCHITECTURE and a != b:
            out[f.name] = (a, b)
    return out


def layout_record(layout) -> dict:
    """meta.json's record of the saving layout (a hybridflow.parallel.layout.Layout, or None)."""
    if layout is None:
        return {"world_size": dist.get_world_size()}
    return {"world_size": layout.world_size, "tp": layout.tp_t, "pp": layout.pp_t,
            "dp": layout.dp_t}


def save_rng(path: str) -> None:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    save_torch(state, os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt"))


def restore_rng(path: str, layout=None) -> bool:
    """Restore this rank's RNG states when the checkpoint was saved in the current layout (`layout`;
    None: only the world size is compared)."""
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    meta = read_json(os.path.join(path, "meta.json"))
    if not os.path.exists(rng_file) or any(meta.get(k) != v
                                           for k, v in layout_record(layout).items()):
        return False
    from hybridflow.checkpoint.unreadable import named_file

    with named_file(rng_file):
        state = torch.load(rng_file, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    return True


def save_torch(obj, path: str) -> None:
    """torch.save through a plain file write: a full disk is then an OSError with its errno, not
    the zip writer's RuntimeError ("file write failed")."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: incomplete checkpoint?")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg}: line {e.lineno} column {e.colno}); "
                             "expected the file as the save wrote it") from None
