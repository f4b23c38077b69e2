"""What every results JSON of benchmarks/ records about its run, and how it is written.

- `machine()`: host, CPUs, Python, GPU name and count, CUDA;
- `versions(*names)`: Python, torch and the named distributions (None where not installed);
- `command()`: the command line as it was typed (interpreter, script, arguments);
- `write_json(path, obj)`: atomic (a temporary file renamed into place), so a reader, or a run cut
  by its time limit mid-write, sees the old file or the new one, never half of one.
torch is imported inside the functions: a driver may record before its GPU work starts.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import shlex
import sys
from pathlib import Path


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    else:
        info["gpu"] = "cpu"
    return info


def versions(*names: str) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def command() -> str:
    return " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv])


def write_json(path: str | os.PathLike, obj: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
