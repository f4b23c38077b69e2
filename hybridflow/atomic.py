"""Outputs that a reader never sees half-written, and that a failure does not leave behind.

- `atomic_write(path, write)`: one file, written under a temporary name beside it and renamed.
- `staged_dir(dest, replace=...)`: a folder of files (a dataset, an exported model), written into
  a new temporary folder beside `dest` (same filesystem, so publishing is a rename and needs no
  space) and published only when every file is complete. On any error the temporary folder is
  removed and an OSError names `dest` (or the file under it), not the temporary name. Publishing:
  - `dest` absent: the folder is renamed to `dest`: all or nothing.
  - `dest` a folder, replace=True (an exported model): it is swapped for the new one whole.
  - `dest` a folder, replace=False (a dataset folder that may hold other files): each new file is
    moved into it with os.replace; its other files stay. Each file is atomic, the set is not: a
    kill between the moves (renames only, no data written) can leave old and new files mixed.
  A killed process (SIGKILL, power loss) can leave its `<dest>.tmp-<id>` folder; nothing reads it.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager


def atomic_write(path: str, write) -> None:
    """write(tmp) to a temporary name beside `path`, then rename it onto `path` (a reader never
    sees a partial file; a failed write leaves no temporary behind)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _naming(e: OSError, tmp: str, dest: str) -> OSError:
    """`e` naming `dest` (or the file under it) where it named the temporary folder or nothing."""
    name = e.filename
    if name is None:
        name = dest
    elif isinstance(name, str) and (name == tmp or name.startswith(tmp + os.sep)):
        name = dest + name[len(tmp):]
    else:
        return e  # some other path (a file being read): it is the one to name
    return OSError(e.errno, e.strerror or str(e), name)  # OSError picks the errno's subclass


@contextmanager
def staged_dir(dest: str, *, replace: bool):
    """Yield a new temporary folder to write `dest`'s files into; publish it as the module says."""
    dest = os.path.abspath(dest)
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a folder", dest)
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.mkdir(tmp)
    except OSError as e:
        raise _naming(e, tmp, dest) from None
    try:
        yield tmp
        _publish(tmp, dest, replace=replace)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        named = _naming(e, tmp, dest) if isinstance(e, OSError) else e
        if named is e:
            raise
        raise named from e


def _publish(tmp: str, dest: str, *, replace: bool) -> None:
    if not os.path.isdir(dest):
        os.rename(tmp, dest)
    elif replace:
        old = f"{tmp}.old"
        os.rename(dest, old)
        try:
            os.rename(tmp, dest)
        except OSError:
            os.rename(old, dest)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        for name in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, name), os.path.join(dest, name))
        os.rmdir(tmp)
