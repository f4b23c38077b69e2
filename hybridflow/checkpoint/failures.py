"""I/O errors of a checkpoint save, shared by every rank and raised as one OSError.

A rank that fails to write (disk full, quota, read-only, permission) must not leave the others
waiting in a barrier, and the user should read one line, the same on every rank, naming the errno
and the path. So each phase of a save runs under `io_errors()`, which catches this rank's error,
and ends with `raise_on_any_rank()`, an all-gather in place of the barrier: when any rank failed,
rank 0 removes the partial directory and every rank raises the lowest failing rank's error.
torch_dist's writers report through a CheckpointException (a BaseException) that carries their
errors as text, and only on the coordinator: the errno is read back from that text. Some writes go
through torch's zip writer, whose full-disk error has no errno ("unexpected pos 704 vs 598"); an
error without one while the filesystem has under FULL_BYTES left is reported as ENOSPC.
"""

from __future__ import annotations

import errno as errno_codes
import logging
import os
import re
import shutil
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

FULL_BYTES = 1 << 20


@contextmanager
def io_errors():
    """Catch this rank's I/O error (OSError, torch_dist's CheckpointException around one, or the
    RuntimeError of torch's zip writer) into the yielded list, so that it can be shared with the
    other ranks instead of leaving them in a barrier. megatron's writer logs the error it
    re-raises: silenced here (reported once)."""
    caught: list = []
    writer_log = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    level = writer_log.level
    writer_log.setLevel(logging.CRITICAL)
    try:
        yield caught
    except (OSError, CheckpointException, RuntimeError) as e:
        caught.append(e)
    finally:
        writer_log.setLevel(level)


_ERRNO = re.compile(r"\[Errno (\d+)\] ([^\n]*)")


def _describe(e: BaseException, path: Optional[str]) -> Optional[tuple]:
    """(errno, strerror, filename) of this rank's error; None when another rank reports it (a
    CheckpointException's failures, as text, reach only the coordinator)."""
    if isinstance(e, OSError):
        return e.errno, e.strerror or str(e), e.filename
    if isinstance(e, CheckpointException):
        texts = [str(exc) for exc, _ in e.failures.values()]
        if not texts:
            return None
    else:
        texts = [str(e)]
    m = _ERRNO.search(texts[0])
    if m:  # "[Errno 28] No space left on device" (a failed write names no file)
        return int(m.group(1)), m.group(2), None
    if path is not None and _nearly_full(path):
        return errno_codes.ENOSPC, os.strerror(errno_codes.ENOSPC), None
    return None, texts[0].splitlines()[0] if texts[0] else type(e).__name__, None


def _nearly_full(path: str) -> bool:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BYTES


def raise_on_any_rank(err: list, *, what: str, cleanup: Optional[str] = None) -> None:
    """A barrier that also shares errors: when any rank failed, rank 0 removes `cleanup` and every
    rank raises the same OSError (the lowest failing rank's errno and path)."""
    mine = _describe(err[0], cleanup) if err else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [(r, d) for r, d in enumerate(every) if d is not None]
    if not failed and not err:
        return
    if cleanup is not None and dist.get_rank() == 0:
        shutil.rmtree(cleanup, ignore_errors=True)
    if not failed:  # a CheckpointException on a rank whose coordinator has no details
        failed = [(None, (None, (str(err[0]) or type(err[0]).__name__).splitlines()[0], None))]
    r, (code, text, path) = failed[0]
    where = path or cleanup
    rank = f" on rank {r}" if r is not None and dist.get_world_size() > 1 else ""
    if code is None:  # not an I/O error we can name: keep the original's traceback
        raise RuntimeError(f"{what}{rank}: {text}") from (err[0] if err else None)
    raise OSError(code, f"{what}{rank}: {text} ({errno_codes.errorcode.get(code, code)})", where)
