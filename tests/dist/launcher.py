"""Run a function on N CPU ranks over gloo and collect what each rank returns.

`run_ranks(fn, world_size, *args)` starts N fresh processes (an explicit port from `free_port`:
`--master_port 0` hangs, shared/MEGATRON_CPU.md item 7), initialises torch.distributed through
hybridflow's own `init_distributed` (so the megatron CPU shims are active), calls `fn(*args)` on each
and returns the list of per-rank results (anything torch.save can write). A failing rank re-raises
here with its traceback. `fn` must be importable (a module-level function in a test module).

The ranks are forked from a forkserver that has imported torch, megatron-core and hybridflow's
trainer once per test process (multiprocessing's `forkserver` start method with preloaded modules):
a spawned interpreter pays ~6 s of CPU importing them, every rank of every launch. A forked rank
starts with nothing else of the server's (it only imports; no process group, no threads, no CPU
shims installed) and with the environment of the test at the launch, as a spawned one would.
With CUDA the ranks are spawned as before.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

# Rendezvous ports are picked below Linux's ephemeral range (32768-60999), which bind(0) and outgoing
# connections draw from: a gloo connection cannot take the port between the pick and rank 0's bind;
# and below 29500, torch's default, where the benchmark scripts' fixed ports are. Each pytest-xdist
# worker picks from its own slice, so two tests of one session never share a port; a random start in
# the slice keeps another session on the same machine unlikely to pick it too.
PORTS = range(20000, 29000)
_cursor: int | None = None


def _port_slice() -> range:
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw<i>" under xdist, unset without it
    index = int(worker[2:]) % num_workers if worker[2:].isdigit() else 0
    width = len(PORTS) // num_workers
    return PORTS[index * width:(index + 1) * width]


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for rank 0's TCP store (torchrun's --master_port or MASTER_PORT), new on every call."""
    global _cursor
    ports = _port_slice()
    if _cursor is None:
        _cursor = random.SystemRandom().randrange(len(ports))  # tests may seed `random`
    for _ in range(len(ports)):
        _cursor = (_cursor + 1) % len(ports)
        if _bindable(ports[_cursor]):
            return ports[_cursor]
    raise RuntimeError(f"no free port in {ports}")


# imported once by the forkserver, before it forks any rank (what every rank imports anyway)
PRELOAD = ["torch", "megatron.core", "hybridflow.engine", "hybridflow.trainer"]
_preload_set = False


def _start_method() -> str:
    """forkserver on CPU; spawn with CUDA (a fork after the preload's imports might inherit an
    initialised CUDA driver)."""
    global _preload_set
    if torch.cuda.is_available():
        return "spawn"
    if not _preload_set:  # takes effect when the forkserver starts: at this process's first launch
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        _preload_set = True
    return "forkserver"


def _worker(rank, fn, world_size, port, out_dir, args, environ=None):
    if environ is not None:  # the launching test's environment, not the forkserver's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from hybridflow.parallel import groups

    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        groups.init_distributed(timeout_minutes=2)
        result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        groups.destroy()


def run_ranks(fn, world_size: int, *args):
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(fn, world_size, free_port(), out_dir, args,
                                                dict(os.environ)),
                                 nprocs=world_size, start_method=_start_method(), join=False)
        try:
            while not ctx.join():
                pass
        except Exception:
            pass
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result")
            rec = torch.load(path, weights_only=False)
            if not rec["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{rec['error']}")
            results.append(rec["result"])
        return results


def _each(calls: dict) -> dict:
    return {name: fn(*args) for name, (fn, *args) in calls.items()}


def run_each(world_size: int, calls: dict) -> list[dict]:
    """Several calls in one launch of `world_size` ranks, in order: {name: (fn, *args)} -> per rank
    {name: fn(*args)}. Rank start-up (torch, megatron) costs more than a small case itself; each
    `fn` builds its own parallel groups (`init_model_parallel` rebuilds them and re-seeds)."""
    return run_ranks(_each, world_size, calls)
