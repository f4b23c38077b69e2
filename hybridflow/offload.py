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

`ParamOffload(params, device, frozen)` (actor.offload_params): the storages under `params` (each
parameter's own, or the DDP parameter buffer a distributed optimizer's views share) are copied to
pinned host buffers (made once) and resized to 0 bytes by `to_host()`, resized back and refilled
by `to_device()`: the parameter objects, their views and the optimizer's references stay valid,
only their memory comes and goes, and the bytes are restored exactly. `to_host(keep=...)` leaves
storages whose data pointer is in `keep` on the device (those a generator reads in place). The
host copy is refreshed only when the weights changed since it was made (`mark_changed()`, called
after each optimizer step; a frozen LoRA base never changes, so after its first offload nothing is
copied to the host again). `to_device(prefetch=True)` copies on a side stream and returns; the
next `to_device()`/`wait()` makes the current stream wait for it (trainer.offload_ref's scheme).
"""

from __future__ import annotations

import torch

from hybridflow.checkpoint.optim import _parts


def host_copy(t: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """`t` in host memory, pinned when CUDA is there (so copies back can be asynchronous); without
    CUDA, `t` itself on the host. `non_blocking`: the copy from the device is not waited for
    (stream-ordered: a later copy back on the same stream, or an event, orders a use after it)."""
    if not torch.cuda.is_available():
        return t.detach().to("cpu")
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t.detach(), non_blocking=non_blocking)


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



def _bytes_of(storage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class ParamOffload:
    def __init__(self, params, *, device, frozen: bool):
        self.device = torch.device(device)
        self.frozen = frozen
        seen: dict[int, int] = {}  # storage data_ptr -> its index
        self._storages, self._index = [], {}  # id(param) -> its storage's index
        for p in params:
            st = p.untyped_storage()
            if st.data_ptr() not in seen:
                seen[st.data_ptr()] = len(self._storages)
                self._storages.append(st)
            self._index[id(p)] = seen[st.data_ptr()]
        self._nbytes = [st.nbytes() for st in self._storages]
        self._host: list | None = None
        self._valid = [False] * len(self._storages)  # the host copy holds the current bytes
        self._away = [False] * len(self._storages)
        self._stream = self._done = None
        self._most_away = 0

    @property
    def nbytes(self) -> int:
        """Bytes of every storage this moves."""
        return sum(self._nbytes)

    def away_bytes(self) -> int:
        """Bytes of them off the device now."""
        return sum(n for n, away in zip(self._nbytes, self._away) if away)

    def most_away_bytes(self, *, reset: bool = True) -> int:
        """The most bytes that were off the device at once since the last reset."""
        most = self._most_away
        if reset:
            self._most_away = self.away_bytes()
        return most

    def mark_changed(self) -> None:
        """The weights changed on the device (an optimizer step): the next offload copies them."""
        if not self.frozen:
            self._valid = [False] * len(self._storages)

    def host_view(self, p: torch.Tensor) -> torch.Tensor:
        """`p` itself while its storage is on the device, else `p`'s bytes in the host copy."""
        i = self._index.get(id(p))
        if i is None or not self._away[i]:
            return p
        return torch.empty(0, dtype=p.dtype).set_(self._host[i].untyped_storage(),
                                                  p.storage_offset(), p.shape, p.stride())

    @torch.no_grad()
    def to_host(self, keep: frozenset = frozenset()) -> None:
        """Every storage (but those whose data_ptr is in `keep`) to the host; asynchronous on the
        current stream (a later allocation there is ordered after the copy)."""
        self.wait()
        pinned = self.device.type == "cuda"
        if self._host is None:
            self._host = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
                          for n in self._nbytes]
        for i, st in enumerate(self._storages):
            if self._away[i] or st.data_ptr() in keep:
                continue
            if not self._valid[i]:
                self._host[i].copy_(_bytes_of(st, self._nbytes[i]), non_blocking=pinned)
                self._valid[i] = True
            st.resize_(0)
            self._away[i] = True
        self._most_away = max(self._most_away, self.away_bytes())

    @torch.no_grad()
    def to_device(self, *, prefetch: bool = False) -> None:
        """Every storage back (a no-op for those on the device). `prefetch`: the copies run on a
        side stream (CUDA) and this returns at once; memory is allocated at the call."""
        if not any(self._away):
            if not prefetch:
                self.wait()
            return
        back = [i for i, away in enumerate(self._away) if away]
        for i in back:
            self._storages[i].resize_(self._nbytes[i])
            self._away[i] = False
        if self.device.type != "cuda":
            for i in back:
                _bytes_of(self._storages[i], self._nbytes[i]).copy_(self._host[i])
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for i in back:
                dev = _bytes_of(self._storages[i], self._nbytes[i])
                dev.copy_(self._host[i], non_blocking=True)
                dev.record_stream(stream)
            self._done = torch.cuda.Event()
            self._done.record(stream)
        if not prefetch:
            self.wait()

    def wait(self) -> None:
        """The current stream waits for a prefetching `to_device` (no-op without one)."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._done = None
