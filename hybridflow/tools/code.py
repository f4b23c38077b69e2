"""`code_interpreter`: Python code run in a sandboxed process per call.

Each call: a fresh temporary working directory (deleted after), `python -I -B` (isolated: no user
site, no PYTHON* env, no bytecode writes) running a small runner (`_CHILD_SOURCE`: the limits, an
audit hook, then the snippet), with
- wall time `timeout_s` (the process group is killed), CPU time `cpu_s` (RLIMIT_CPU), address space
  `memory_mb` (RLIMIT_AS), output file size (RLIMIT_FSIZE) and no core files: the runner sets
  them (the hard limits too, so the snippet cannot raise them) before it reads the snippet. Not a
  `preexec_fn`: that makes subprocess fork() the whole trainer (page tables of every host
  mapping) with the GIL held, stalling the decode loop for each call; without it the spawn is a
  vfork/exec, and the wait for the child blocks on a pidfd (no polling wake-ups taking the GIL);
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
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridflow.tools.base import Tool, ToolTimeout, register_tool

# the child process's runner, written into each call's working directory (see its docstring)
_CHILD_SOURCE = r'''"""Runs in the sandbox's child process (python -I -B this_file WORKDIR): installs an audit hook that
refuses process creation, sockets and writes outside WORKDIR, then executes
WORKDIR/snippet.py with WORKDIR as the working directory. Audit hooks cannot be removed once added.
Before anything else: the resource limits of argv[2:] (CPU seconds, address-space and file-size
bytes), soft and hard, and no core files."""

import os
import resource
import sys

_CPU, _MEM, _FSIZE = (int(a) for a in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_CPU, (_CPU, _CPU + 1))
resource.setrlimit(resource.RLIMIT_AS, (_MEM, _MEM))
resource.setrlimit(resource.RLIMIT_FSIZE, (_FSIZE, _FSIZE))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
ROOT = os.path.realpath(sys.argv[1])
_PROCESS = {"os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
            "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "os.startfile",
            "webbrowser.open"}
_PATHS = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1,
          "os.chown": 1, "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1,
          "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.copytree": 2, "shutil.move": 2}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _inside(path) -> bool:
    if isinstance(path, int):
        return True  # a descriptor it already holds
    p = os.path.realpath(os.fsdecode(path))
    return p == ROOT or p.startswith(ROOT + os.sep)


def _hook(event, args):
    if event in _PROCESS or event.startswith("socket."):
        raise PermissionError(f"{event} is not allowed in the sandbox")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"writing {os.fsdecode(path)!r} is not allowed: only files "
                                  "in the working directory may be written")
    elif event in _PATHS:
        for p in args[:_PATHS[event]]:
            if p is not None and not _inside(p):
                raise PermissionError(f"{event} on {os.fsdecode(p)!r} is not allowed outside the "
                                      "working directory")


def main():
    os.chdir(ROOT)
    with open(os.path.join(ROOT, "snippet.py")) as f:
        code = f.read()
    sys.addaudithook(_hook)
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:  # the traceback of the snippet's frames only (not this runner's)
        import traceback

        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
        sys.stdout.flush()
        print("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
              + "".join(traceback.format_exception_only(type(e), e)), end="", file=sys.stderr)
        sys.exit(1)


main()
'''


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


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    """proc.wait(timeout) blocking on a pidfd (Linux >= 5.3): one wake-up when the child exits,
    where Popen.wait polls with sleeps of 0.5-50 ms, each taking the GIL."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd here: Popen's polling wait
        return proc.wait(timeout=timeout)
    try:
        poll = select.poll()  # not select.select: a trainer's descriptors may pass FD_SETSIZE
        poll.register(fd, select.POLLIN)
        if not poll.poll(max(0, int(timeout * 1000))):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(fd)
    return proc.wait()


def run_python(code: str, *, timeout_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
               max_output_chars: int = 2048, isolate_network: bool = True) -> tuple[str, str]:
    """Run `code` in the sandbox -> (output text, status): status "ok", "error" (nonzero exit: an
    exception, a refused operation, the memory limit) or "timeout" (wall or CPU limit)."""
    work = tempfile.mkdtemp(prefix="hf_sandbox_")
    try:
        Path(work, "snippet.py").write_text(code)
        Path(work, ".runner.py").write_text(_CHILD_SOURCE)
        out_path = Path(work, ".output")
        limit_bytes = 4 * max(max_output_chars, 1024) + 65536

        cmd = [sys.executable, "-I", "-B", str(Path(work, ".runner.py")), work, str(int(cpu_s)),
               str(memory_mb * 1024 * 1024), str(limit_bytes)]
        if isolate_network and network_namespace_available():
            cmd = ["unshare", "-rn", *cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        status = "ok"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=work, env=env,
                                    start_new_session=True)
            try:
                rc = _wait(proc, timeout_s)
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
