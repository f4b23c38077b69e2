"""Runs in the sandbox's child process (python -I -B this_file WORKDIR): installs an audit hook that
refuses process creation, sockets and writes outside WORKDIR, then executes
WORKDIR/snippet.py with WORKDIR as the working directory. Audit hooks cannot be removed once added."""

import os
import sys

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
