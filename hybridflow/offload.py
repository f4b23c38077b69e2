"""Optimizer offload (actor.offload_optimizer): the optimizer's fp32 master weights and Adam moments
live in host memory and come to the device only for the optimizer step.

`OptimizerOffload(optimizer, model_params, device)`: `to_host()` copies every offloadable tensor into
its host buffer (pinned with CUDA, made once and reused) and points the optimizer at it, freeing the
device copy; `to_device()` allocates device tensors, copies back and points the optimizer at them.
Offloadable: the Adam state tensors (all but the scalar `step`, which fused Adam reads on the
device) and the master weights in the optimizer's param groups that are not model parameters
(bf16 training's fp32 copies; with fp32 training the optimizer steps the model's own weights,
which stay). Copies are exact, so a run with offload is bit-identical to one without. The engine
moves the state back after the update's backward (its activations are gone by then) and out again
right after the step, so the state is on the device only while nothing else is.

`GradBufferRelease(buffers)` (actor.offload_grads): Megatron DDP's gradient buffers (`grad_data`,
which every param's `main_grad` and the optimizers' grad views are views of) have their storage
resized to 0 bytes after the optimizer step and back before the next update, which zeroes them
first anyway: nothing is copied, the views stay valid objects (pointing at the re-allocated
storage). The FSDP trick the reshard buffers use too.
"""

from __future__ import annotations

import torch

from hybridflow.checkpoint.optim import _parts


class OptimizerOffload:
    def __init__(self, optimizer, *, model_params, device):
        self.optimizer = optimizer
        self.device = torch.device(device)
        self._model = {id(p) for p in model_params}
        self._host: dict[tuple, torch.Tensor] = {}  # slot -> host buffer
        self.on_host = False

    def _slots(self):
        """(key, getter, setter) of every offloadable tensor, in a fixed order."""
        for i, part in enumerate(_parts(self.optimizer)):
            opt = part.optimizer
            for j, g in enumerate(opt.param_groups):
                for k, p in enumerate(g["params"]):
                    if id(p) not in self._model:
                        yield ((i, "param", j, k), lambda p=p: p.data,
                               lambda t, p=p: setattr(p, "data", t))
            for k, (p, st) in enumerate(opt.state.items()):
                for name in sorted(st):
                    if name != "step" and torch.is_tensor(st[name]):
                        yield ((i, "state", k, name), lambda st=st, n=name: st[n],
                               lambda t, st=st, n=name: st.__setitem__(n, t))

    @torch.no_grad()
    def to_host(self) -> None:
        for key, get, put in self._slots():
            t = get()
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                   pin_memory=torch.cuda.is_available())
                self._host[key] = host
            if host.data_ptr() != t.data_ptr():
                host.copy_(t)
            put(host)
        self.on_host = True

    @torch.no_grad()
    def to_device(self) -> None:
        for key, get, put in self._slots():
            t, host = get(), self._host.get(key)
            if t.device == self.device and (host is None or t.data_ptr() != host.data_ptr()):
                continue  # a device tensor already (e.g. state the last step created there)
            dev = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            dev.copy_(t, non_blocking=True)
            put(dev)
        self.on_host = False


class GradBufferRelease:
    def __init__(self, buffers):
        self._storages = {}
        for b in buffers:
            st = b.grad_data.untyped_storage()
            self._storages[id(st)] = (st, st.nbytes())
        self.released = False

    def release(self) -> None:
        for st, _ in self._storages.values():
            st.resize_(0)
        self.released = True

    def restore(self) -> None:
        if self.released:
            for st, nbytes in self._storages.values():
                st.resize_(nbytes)
            self.released = False

