"""A real small filesystem for I/O-error tests: a tmpfs mounted for the duration of a `with`.

Mounting needs root (CI containers run as root); elsewhere the test is skipped rather than faked.
`mount_tmpfs(path, size="1m", read_only=False)` yields `path`; `fill(path, leave=0)` writes until
ENOSPC, then frees `leave` bytes (room for part of what a test writes next).
"""

from __future__ import annotations

import errno
import os
import subprocess
from contextlib import contextmanager

import pytest


@contextmanager
def mount_tmpfs(path: str, *, size: str = "1m", read_only: bool = False):
    os.makedirs(path, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def fill(path: str, *, leave: int = 0) -> None:
    """Write a file in `path` until the filesystem is full, then give back `leave` bytes of it."""
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        f.truncate(max(0, f.tell() - leave))
