"""Run megatron-core on a machine without CUDA (development laptops, CI).

megatron-core assumes CUDA in a handful of places that have nothing to do with the math: RNG state
tracking, scratch buffers placed on `torch.cuda.current_device()`, streams/events for overlap, and
`device='cuda'` literals in the optimizer. Each fix below is the smallest one measured to work with
megatron-core 0.16.1 on torch 2.13 CPU:

1. CUDA RNG state calls go to the CPU generator (the model-parallel RNG tracker then works unchanged).
2. `torch.cuda.current_device()` returns the CPU device, so scratch buffers are allocated on CPU.
3. Streams, events, synchronize and nvtx become no-ops: CPU ops are synchronous.
4. A TorchFunctionMode maps `device='cuda'` to CPU, makes `.cuda()` / `pin_memory()` no-ops and reports
   CUDA type names to Megatron's own `.type()` checks (grad clipping, optimizer) and nobody else's.
   The mode is entered on the main thread (torch function modes are thread-local).
5. MoE's alltoall token dispatcher turns its split sizes into host numpy arrays only when they
   are CUDA tensors (`maybe_move_tensor_to_cpu`); CPU tensors would reach `all_to_all_single`,
   which takes sequences of ints: the dispatcher's copy of that function converts CPU ones too.

`install()` is called once by `hybridflow.parallel.groups` before megatron builds anything, and only
when `torch.cuda.is_available()` is False. No other module knows this file exists.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _called_from_megatron() -> bool:
    """Only Megatron's own `.type() == 'torch.cuda.FloatTensor'` checks see CUDA type names."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("torch"):
            return module.startswith("megatron.")
        frame = frame.f_back
    return False


def _map_device(value):
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, int) and not isinstance(value, bool):
        return "cpu"  # megatron passes torch.cuda.current_device() ints as devices
    return value


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement requests to CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in ("cuda", "pin_memory") and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            out = func(*args)
            return _CUDA_TYPE_NAMES.get(out, out) if _called_from_megatron() else out
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if name == "to" and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], _map_device(args[1])) + tuple(args[2:])
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def install() -> None:
    """Patch torch.cuda / megatron for CPU execution. Idempotent; no-op when CUDA is present."""
    global _INSTALLED, _MODE
    if _INSTALLED or torch.cuda.is_available():
        return
    cpu_gen = torch.default_generator

    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda device="cuda": cpu_gen.get_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": cpu_gen.set_state(state)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.device_count = lambda: 0
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device=-1, clone=False, graph_safe=False: (
        cpu_gen.get_state().clone() if clone else cpu_gen.get_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: cpu_gen.set_state(
        new_state
    )

    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host

    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _INSTALLED = True


def installed() -> bool:
    return _INSTALLED
