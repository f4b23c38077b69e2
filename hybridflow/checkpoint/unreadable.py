"""Name the file when a checkpoint does not read back: a JSON file that does not parse, the
torch_dist index, a shard shorter than its index says, a torch file that is not a whole zip. Export
and resume turn what the readers raise into one ValueError naming that file."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import zipfile

# what a truncated or corrupt file raises, from json, pickle, torch's zip reader and torch_dist's
# readers (CheckpointException is a BaseException wrapping the per-rank error)
def _errors() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException

    return (json.JSONDecodeError, EOFError, pickle.UnpicklingError, RuntimeError,
            zipfile.BadZipFile, CheckpointException)


@contextlib.contextmanager
def named(ckpt: str, role: str):
    """Reading role `role` of the `step_<N>` dir `ckpt`: a reader failure -> ValueError(describe)."""
    try:
        yield
    except _errors() as e:
        raise ValueError(describe(ckpt, role, e)) from None


@contextlib.contextmanager
def named_file(path: str):
    """Reading the one file `path` (trainer state, RNG states)."""
    try:
        yield
    except _errors() as e:
        first = " ".join(str(e).split())[:120]
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {first}); expected the file as "
                         "the save wrote it") from None


def describe(ckpt: str, role: str, e: BaseException) -> str:
    """Name the file that made reading fail: a JSON file that does not parse, the torch_dist index
    (`.metadata`), a shard shorter than the index says, a torch file that is not a whole zip."""
    from torch.distributed.checkpoint import FileSystemReader

    role_dir, expected = os.path.join(ckpt, role), "expected the file as the save wrote it"
    for path in (os.path.join(ckpt, f"model_config_{role}.json"),
                 os.path.join(role_dir, "metadata.json")):
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except json.JSONDecodeError as bad:
            where = f"line {bad.lineno} column {bad.colno}"
            return f"{path}: not valid JSON ({bad.msg}: {where}); {expected}"
        except OSError:  # absent: not what failed
            continue
    try:
        index = FileSystemReader(role_dir).read_metadata()
    except Exception as bad:  # pickle, EOF, attribute errors of a half-read object
        return f"{role_dir}/.metadata: unreadable ({type(bad).__name__}: {bad}); {expected}"
    needs: dict[str, int] = {}
    for item in index.storage_data.values():
        needs[item.relative_path] = max(needs.get(item.relative_path, 0), item.offset + item.length)
    for name, need in sorted(needs.items()):
        path = os.path.join(role_dir, name)
        size = os.path.getsize(path)
        if size < need:
            return f"{path}: truncated: {size} bytes, its checkpoint index needs {need}; {expected}"
    for name in sorted(os.listdir(role_dir)):
        if name.endswith(".pt"):
            try:
                with zipfile.ZipFile(os.path.join(role_dir, name)) as z:
                    z.testzip()
            except zipfile.BadZipFile as bad:
                return f"{role_dir}/{name}: not a readable torch file ({bad}); {expected}"
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (error, traceback)}
    cause = next(iter(failures.values()))[0] if failures else e
    first = re.split(r"(?<=\.)\s", " ".join(str(cause).split()), maxsplit=1)[0][:120]
    return (f"{role_dir}: cannot read the saved {role} weights ({type(cause).__name__}: {first}); "
            "a file under it is corrupt")


