"""Triton's CPU interpreter (TRITON_INTERPRET=1) for the kernel tests.

`run_check(script, *args)`: the test side. A check script (tests/unit/*_check.py) runs in a fresh
interpreter with TRITON_INTERPRET=1 (Triton reads the variable when the kernels are defined, so it
must be set before the first import of the kernels in the process) and prints one JSON object
last; the test reads it (and skips without triton).

`patch()`: the check scripts' side, under numpy 2: a kernel scalar (a loaded value, a program id)
is a one-element array there, and using it as a loop bound calls int() on it, which numpy 2
refuses for arrays of one dimension. It makes the interpreter take the element, as compiled
Triton takes the scalar; the check scripts call it before their first launch."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_check(script: str, *args, timeout: int = 600) -> dict:
    """tests/unit/`script` with `args` under the interpreter -> its last stdout line as JSON."""
    import pytest

    from hybridflow.kernels._dispatch import HAVE_TRITON

    if not HAVE_TRITON:
        pytest.skip("needs the triton package (its CPU interpreter)")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, f"tests/unit/{script}", *map(str, args)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def patch() -> None:
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "scalar_index", False):
        return

    def patched(tensor):
        patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    patched.scalar_index = True
    interpreter._patch_lang_tensor = patched
