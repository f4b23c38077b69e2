"""How hybridflow's command-line tools fail on bad input: one line on stderr, exit code 2.

    hybridflow <tool>: error: <path>: <what> (<errno name>)     an I/O error
    hybridflow <tool>: error: <message>                          any other user error

The tools (export, prepare, cost, calibrate) end this way on what a user can get wrong: a
ValueError (a bad value, a file that does not parse: its message names the key or path and what
was expected), an OSError (its errno's name and the path it names), an EOFError (a file cut
short) and argparse's usage errors. Anything else is a bug and keeps its traceback. The trainer
prints its own lines (hybridflow.watchdog: every rank, rank prefixes) under the same prefix, so
one pattern, `hybridflow .*: error:`, finds every tool's errors in any log.
"""

from __future__ import annotations

import argparse
import errno
import functools
import sys
from typing import Callable

USER_ERRORS = (ValueError, OSError, EOFError)


def prefix(tool: str) -> str:
    return f"hybridflow {tool}: error: "


def describe(e: BaseException) -> str:
    """One line for a user error: `<path>: <what> (<ENAME>)` for an OSError with an errno."""
    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        what = f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})"
        if e.filename is None:
            return what
        where = e.filename if e.filename2 is None else f"{e.filename} -> {e.filename2}"
        return f"{where}: {what}"
    return " ".join(str(e).split()) or type(e).__name__


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are user errors like any other (one line, exit code 2)."""

    def error(self, message: str):
        raise ValueError(f"{message} (see {self.prog} --help)")


def tool(name: str) -> Callable:
    """Decorate a tool's `main(argv) -> int`: a user error prints its line and returns 2."""
    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except USER_ERRORS as e:
                sys.stdout.flush()
                sys.stderr.write(prefix(name) + describe(e) + "\n")
                return 2
        return run
    return wrap
