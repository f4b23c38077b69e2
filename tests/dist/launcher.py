"""Run a function on N CPU ranks over gloo and collect what each rank returns.

`run_ranks(fn, world_size, *args)` spawns N fresh processes (explicit free port: `--master_port 0`
hangs, shared/MEGATRON_CPU.md item 7), initialises torch.distributed through hybridflow's own
`init_distributed` (so the megatron CPU shims are active), calls `fn(*args)` on each and returns the
list of per-rank results (anything torch.save can write). A failing rank re-raises here with its
traceback. `fn` must be importable (a module-level function in a test module).
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, out_dir, args):
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
        ctx = mp.start_processes(_worker, args=(fn, world_size, _free_port(), out_dir, args),
                                 nprocs=world_size, start_method="spawn", join=False)
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
