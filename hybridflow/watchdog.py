"""Which stage each rank is in, and one line (never a hang or a silent exit) when a run fails.

    hybridflow train: error: rank 1: stage old_log_prob: peer failure after 0.4 s (Connection reset by peer)

Stages are the trainer's StageTimer names (reshard, gen, old_log_prob, ref, values, reward, adv,
update_critic, update_actor) inside the entry point's own (startup, train, resume, save). `stage()`
keeps a stack for the main thread and tags an exception that leaves a stage with the innermost one
and its elapsed seconds, so the entry point can say where it came from.

How a rank learns that a peer is gone, each ending in the line above and an exit within a bound:
- the collective raises: gloo reports a closed socket at once and a silent peer after
  trainer.collective_timeout_s (given to every process group); NCCL raises DistBackendError when
  its own watchdog aborts the communicator (when it kills the process instead, the launcher's
  SIGTERM below gives the other ranks their line).
- torchrun stops every rank with SIGTERM once one exits. Python runs signal handlers only between
  bytecodes of the main thread, which may sit in a collective for minutes; so the handler is a
  no-op and a watcher thread, woken through `signal.set_wakeup_fd`'s pipe, prints and exits.
CUDA out of memory gets the same treatment with what was asked and a hint for the stage.

User errors (config, input, storage) print `hybridflow train: error: <msg>` on every rank that
finds them: before process groups exist every rank reads the same config, so the line is the same;
after, ranks compare messages through the rendezvous store (for at most AGREE_S) and prefix
`rank R: ` only when they disagree. Every rank prints before it exits, so no launcher ordering
(torchrun kills the others when the first exits) can swallow the line. Lines go out in one
write(2) each, so lines of ranks sharing a terminal do not interleave. torch is imported only
where needed: the entry point reports config errors before it imports torch (a launch that fails
validation costs ~0.5 s).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Optional

from hybridflow import cli

AGREE_S = 2.0  # how long ranks wait for each other's message before printing theirs with the rank

_stack: list[tuple[str, float]] = []  # (stage, start) of the main thread, innermost last
_started = time.monotonic()
_once = threading.Lock()  # one report per process: the main thread's or the watcher's
_pending: list[str] = []  # a user error this rank is printing (the watcher prints it if killed)
_watching = False


@contextmanager
def stage(name: str):
    """Enter stage `name`; an exception leaving it remembers (name, seconds in it)."""
    t0 = time.monotonic()
    _stack.append((name, t0))
    try:
        yield
    except BaseException as e:
        if getattr(e, "hybridflow_stage", None) is None:
            try:
                e.hybridflow_stage = (name, time.monotonic() - t0)
            except AttributeError:  # a few C exception types take no attributes
                pass
        raise
    finally:
        _stack.pop()


def current() -> tuple[str, float]:
    """(innermost stage, seconds in it); ("startup", seconds since import) outside any."""
    if not _stack:
        return "startup", time.monotonic() - _started
    name, t0 = _stack[-1]
    return name, time.monotonic() - t0


# ------------------------------------------------------------------------------ failure lines
_COLLECTIVE = re.compile(r"gloo|nccl|processgroup|c10d|connection (reset|closed|refused)|"
                         r"broken pipe|timed out", re.IGNORECASE)
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def failure_kind(e: BaseException) -> Optional[str]:
    """'oom', 'non-finite', 'timeout', 'peer failure', or None (not a failure this module explains)."""
    import torch
    import torch.distributed as dist

    from hybridflow.nonfinite import NonFiniteGradients

    if isinstance(e, torch.OutOfMemoryError):
        return "oom"
    if isinstance(e, NonFiniteGradients):
        return "non-finite"
    if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and _COLLECTIVE.search(str(e))):
        return "timeout" if _TIMEOUT.search(str(e)) else "peer failure"
    return None


def failure_line(e: BaseException, *, rank: int) -> Optional[str]:
    """`rank R: stage S: <what> after T s (<cause>)` for a collective failure or an OOM, else None."""
    kind = failure_kind(e)
    if kind is None:
        return None
    name, secs = getattr(e, "hybridflow_stage", None) or current()
    if kind == "non-finite":
        return f"rank {rank}: stage {name}: {e}"
    if kind == "oom":
        return f"rank {rank}: stage {name}: CUDA out of memory after {secs:.1f} s: " \
               f"{_oom_amounts(str(e))}; {oom_hint(name)}"
    return f"rank {rank}: stage {name}: {kind} after {secs:.1f} s ({_first_sentence(str(e))})"


def _first_sentence(text: str) -> str:
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.strip().splitlines()[0] if text else "")
    return text.split(". ")[0][:200]


_SIZE = r"([\d.]+ [KMGT]?i?B)"


def _oom_amounts(text: str) -> str:
    asked = re.search(r"Tried to allocate " + _SIZE, text)
    free = re.search(r"of which " + _SIZE + " is free", text)
    total = re.search(r"total capacity of " + _SIZE, text)
    if asked is None:
        return _first_sentence(text)
    out = f"asked for {asked.group(1)}"
    if free is not None:
        out += f" with {free.group(1)} free"
    if total is not None:
        out += f" of {total.group(1)}"
    return out


_FWD = ("lower algo.forward_micro_batch_size_per_gpu (with algo.use_dynamic_bsz: "
        "algo.forward_max_tokens_per_micro_batch_per_gpu)")
_UPDATE = ("lower algo.micro_batch_size_per_gpu (with algo.use_dynamic_bsz: "
           "algo.max_tokens_per_micro_batch_per_gpu), or spread the model (a larger "
           "parallel.tensor_parallel_size / pipeline_parallel_size)")
_OOM_HINTS = {
    "reshard": "the gen layout gathers TP_g shards: raise rollout.tensor_parallel_size (TP_g), "
               "or set trainer.offload_ref=true trainer.offload_ref_prefetch=false",
    "gen": "lower rollout.max_batch_size (sequences per generate call), raise "
           "rollout.tensor_parallel_size, or set trainer.offload_ref=true "
           "trainer.offload_ref_prefetch=false",
    "old_log_prob": _FWD,
    "ref": _FWD + " or set trainer.offload_ref=true",
    "values": _FWD,
    "reward": _FWD,
    "update_actor": _UPDATE,
    "update_critic": _UPDATE,
}


def oom_hint(stage_name: str) -> str:
    return "hint: " + _OOM_HINTS.get(
        stage_name, "lower algo.micro_batch_size_per_gpu / forward_micro_batch_size_per_gpu or "
                    "rollout.max_batch_size, set trainer.offload_ref=true, or use more TP/PP")


# ------------------------------------------------------------------------------ reporting
def emit(line: str) -> None:
    """`hybridflow train: error: <line>` on stderr in one write (ranks sharing a terminal); the
    prefix every tool's user errors share (hybridflow.cli)."""
    data = f"{cli.prefix('train')}{line}\n".encode()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    while data:
        data = data[os.write(2, data):]


def exit_now(code: int) -> None:
    """Leave without the collective teardown (destroy_process_group can block on dead peers)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def die(line: str, code: int) -> None:
    """Print `line` and exit, once per process (the main thread or the SIGTERM watcher)."""
    if _once.acquire(blocking=False):
        emit(line)
        exit_now(code)
    threading.Event().wait()  # the other reporter is exiting the process


def user_error(msg: str, *, rank: int, world_size: int, shared: bool) -> int:
    """Print a user error (config, input, storage) the way the module docstring says; return 2.
    shared: process groups exist, so ranks compare messages first."""
    line = msg
    if shared and world_size > 1:
        _pending.append((msg, world_size))
        if not _all_agree(msg, rank=rank, world_size=world_size):
            line = f"rank {rank}: {msg}"
    if not _watching:
        emit(line)
    elif _once.acquire(blocking=False):
        emit(line)  # the caller exits next
    else:
        threading.Event().wait()  # the watcher is printing this message and exiting
    return 2


def _all_agree(msg: str, *, rank: int, world_size: int, wait_s: float = AGREE_S) -> bool:
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"hybridflow/error/{rank}", msg)
        keys = [f"hybridflow/error/{r}" for r in range(world_size)]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if store.check(keys):
                return all(store.get(k).decode() == msg for k in keys)
            time.sleep(0.05)
    except Exception:  # the store went with rank 0, or there is none: speak for this rank
        pass
    return False


# ------------------------------------------------------------------------------ SIGTERM watcher
def watch_sigterm(*, rank: int) -> None:
    """From the main thread, before process groups start: on SIGTERM print this rank's line and
    exit (143), even while the main thread is blocked in a collective."""
    global _watching
    if _watching:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the watcher acts; this only wakes the pipe
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    os.register_at_fork(after_in_child=_unwatch_in_child)
    threading.Thread(target=_watch, args=(read_fd, rank), daemon=True,
                     name="hybridflow-sigterm").start()
    _watching = True


def _watch(read_fd: int, rank: int) -> None:
    while signal.SIGTERM not in os.read(read_fd, 64):  # other signals with Python handlers
        pass
    name, secs = current()
    if _pending:  # the main thread is comparing messages: a peer that agreed may exit first
        msg, world_size = _pending[0]
        agreed = _all_agree(msg, rank=rank, world_size=world_size, wait_s=0.2)
        die(msg if agreed else f"rank {rank}: {msg}", 2)
    die(f"rank {rank}: stage {name}: peer failure after {secs:.1f} s (SIGTERM: the launcher "
        "stops every rank once one exits, or the job was cancelled)", 143)


def _unwatch_in_child() -> None:
    """A forked helper (checkpoint writers) must not wake the parent's watcher."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from a thread other than the main one: it cannot be changed
        pass
