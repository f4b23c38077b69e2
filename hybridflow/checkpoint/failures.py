"""I/O errors of a checkpoint save, shared by every rank and raised as one OSError.

A rank that fails to write (disk full, quota, read-only, permission) must not leave the others
waiting in a barrier, and the user should read one line, the same on every rank, naming the errno
and the path. So each phase of a save runs under `io_errors()`, which catches this rank's error,
and ends with `raise_on_any_rank()`, an all-gather in place of the barrier: when any rank failed,
rank 0 removes the partial directory and every rank raises the lowest failing rank's error.
torch_dist's writers report through a CheckpointException (a BaseException) that carries their
errors as text, and only on the coordinator: the errno is read back from that text.
"""

from __future__ import annotations

import errno as errno_codes
import logging
import re
import shutil
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException


@contextmanager
def io_errors():
    """Catch this rank's I/O error (OSError, or torch_dist's CheckpointException around one) into
    the yielded list, so that it can be shared with the other ranks instead of leaving them in a
    barrier. megatron's writer logs the error it re-raises: silenced here (reported once)."""
    caught: list = []
    writer_log = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    level = writer_log.level
    writer_log.setLevel(logging.CRITICAL)
    try:
        yield caught
    except (OSError, CheckpointException) as e:
        caught.append(e)
    finally:
        writer_log.setLevel(level)


_ERRNO = re.compile(r"\[Errno (\d+)\] ([^\n]*)")


def _describe(e: BaseException) -> Optional[tuple]:
    """(errno, strerror, filename) of an OSError, or of the first one a CheckpointException
    reports (its failures hold the writers' errors as text; only the coordinator has them)."""
    if isinstance(e, OSError):
        return e.errno, e.strerror or str(e), e.filename
    for exc, _ in getattr(e, "failures", {}).values():
        m = _ERRNO.search(str(exc))
        if m:  # "[Errno 28] No space left on device" (writes name no file)
            return int(m.group(1)), m.group(2), None
        return None, str(exc).splitlines()[0], None
    return None  # another rank reports it


def raise_on_any_rank(err: list, *, what: str, cleanup: Optional[str] = None) -> None:
    """A barrier that also shares errors: when any rank failed, rank 0 removes `cleanup` and every
    rank raises the same OSError (the lowest failing rank's errno and path)."""
    mine = _describe(err[0]) if err else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [(r, d) for r, d in enumerate(every) if d is not None]
    if not failed and not err:
        return
    if cleanup is not None and dist.get_rank() == 0:
        shutil.rmtree(cleanup, ignore_errors=True)
    if not failed:  # a CheckpointException on a rank whose coordinator has no details
        failed = [(None, (None, str(err[0]), None))]
    r, (code, text, path) = failed[0]
    where = path or cleanup
    rank = f" on rank {r}" if r is not None and dist.get_world_size() > 1 else ""
    if code is None:
        raise RuntimeError(f"{what}{rank}: {text}")
    raise OSError(code, f"{what}{rank}: {text} ({errno_codes.errorcode.get(code, code)})", where)
