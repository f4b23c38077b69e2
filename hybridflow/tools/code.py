"""`code_interpreter`: Python code run in a sandboxed process per call.

Each call: a fresh temporary working directory (deleted after), `python -I -B` (isolated: no user
site, no PYTHON* env, no bytecode writes) running hybridflow/tools/_sandbox_child.py, with
- wall time `timeout_s` (the process group is killed), CPU time `cpu_s` (RLIMIT_CPU), address space
  `memory_mb` (RLIMIT_AS), output file size (RLIMIT_FSIZE) and no core files;
- no network: the child starts in a new, empty network namespace (`unshare -rn`) when the machine
  allows unprivileged user namespaces (probed once); in every case its audit hook refuses every
  `socket.*` event, so a connection attempt raises PermissionError either way;
- no processes: `os.system`, `subprocess`, `os.fork`/`exec*`/`posix_spawn` are refused by the
  audit hook (PermissionError in the code);
- writes outside the working directory refused (audit hook on open/remove/rename/mkdir/...).
This is containment for model-written code in training, not a security boundary against hostile
code (an audit hook is in-process: a native extension could bypass it).
Output: stdout and stderr together, truncated to `max_output_chars` (the middle elided); a failing
run returns its traceback's text; the model always gets text, the trainer never an exception.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridflow.tools.base import Tool, ToolTimeout, register_tool

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare -rn` runs here (unprivileged user + network namespaces)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def truncate_middle(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    note = f"\n...[{len(text) - limit} characters truncated]...\n"
    head = max(0, (limit - len(note)) // 2)
    return text[:head] + note + text[len(text) - (limit - len(note) - head):] if limit > len(
        note) else text[:limit]


def run_python(code: str, *, timeout_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
               max_output_chars: int = 2048, isolate_network: bool = True) -> tuple[str, str]:
    """Run `code` in the sandbox -> (output text, status): status "ok", "error" (nonzero exit: an
    exception, a refused operation, the memory limit) or "timeout" (wall or CPU limit)."""
    work = tempfile.mkdtemp(prefix="hf_sandbox_")
    try:
        Path(work, "snippet.py").write_text(code)
        out_path = Path(work, ".output")
        limit_bytes = 4 * max(max_output_chars, 1024) + 65536

        def limits():
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
            mem = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        cmd = [sys.executable, "-I", "-B", _CHILD, work]
        if isolate_network and network_namespace_available():
            cmd = ["unshare", "-rn", *cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        status = "ok"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=work, env=env,
                                    preexec_fn=limits, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, status = None, "timeout"
        raw = out_path.read_bytes()
        text = raw[:limit_bytes].decode("utf-8", "replace")
        if len(raw) >= limit_bytes and rc is not None and rc > 0:
            status = "ok"  # it printed past the file-size limit: the output is cut, not failed
            text = raw[:limit_bytes // 2].decode("utf-8", "replace")
        elif status == "timeout":
            text += f"\nTimeoutError: the code ran longer than {timeout_s:g} s"
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL):
            status = "timeout"
            text += f"\nTimeoutError: the code used more than {cpu_s} s of CPU time"
        elif rc != 0:
            status = "error"
            if rc < 0:
                text += f"\nError: the process was killed by signal {-rc}"
        return truncate_middle(text, max_output_chars), status
    finally:
        shutil.rmtree(work, ignore_errors=True)


@register_tool("code_interpreter")
class CodeInterpreter(Tool):
    """arguments {"code": "..."} -> the run's output (see run_python); limits from the config."""

    def __init__(self, *, name: str, schema: dict, timeout_s: float = 10.0, cpu_s: int = 10,
                 memory_mb: int = 1024, max_output_chars: int = 2048,
                 isolate_network: bool = True):
        super().__init__(name=name, schema=schema)
        self.limits = dict(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                           max_output_chars=max_output_chars, isolate_network=isolate_network)

    async def execute(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("code_interpreter needs a string argument 'code'")
        text, status = run_python(code, **self.limits)
        if status == "timeout":
            raise ToolTimeout(text.strip())
        if status == "error":
            raise RuntimeError(text.strip() or "the code failed without output")
        return text
