"""The tool registry, the Tool interface and verl's tool-config YAML (see hybridflow/tools/__init__)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

_REGISTRY: dict[str, Callable[..., "Tool"]] = {}


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolOutcome:
    """What a call gave the model (`text`) and how it went: error (the tool raised, the call did
    not parse, or the tool is unknown), timeout (the tool's own limit), seconds on the wall."""
    text: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0


class ToolTimeout(Exception):
    """Raised by a tool whose call ran past its time limit (counted as a timeout)."""


class Tool:
    """Base class: `name`, `schema` (the OpenAI function schema) and `async execute(arguments)`.
    Subclasses take their config dict's keys as keyword arguments."""

    def __init__(self, *, name: str, schema: dict):
        self.name, self.schema = name, schema

    async def execute(self, arguments: dict) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def run(self, call: ToolCall) -> ToolOutcome:
        """Run one call to the end on the calling thread; whatever goes wrong is text for the model
        (a tool never raises into the trainer)."""
        t0 = time.perf_counter()
        try:
            text = _thread_loop().run_until_complete(self.execute(dict(call.arguments)))
            out = ToolOutcome(text=str(text))
        except ToolTimeout as e:
            out = ToolOutcome(text=f"Error: {e}", error=True, timeout=True)
        except Exception as e:  # noqa: BLE001 - reported to the model, counted in tool_errors
            out = ToolOutcome(text=f"Error: {type(e).__name__}: {e}", error=True)
        out.seconds = time.perf_counter() - t0
        return out


_LOOPS = threading.local()


def _thread_loop() -> asyncio.AbstractEventLoop:
    """The calling thread's event loop for tools' coroutines, made once per thread: asyncio.run
    makes and closes one per call (~0.4 ms of Python holding the GIL, which a tool thread takes
    from the decode loop)."""
    loop = getattr(_LOOPS, "loop", None)
    if loop is None or loop.is_closed():
        loop = _LOOPS.loop = asyncio.new_event_loop()
        weakref.finalize(threading.current_thread(), loop.close)  # with the thread
    return loop


class FunctionTool(Tool):
    """A plain function as a tool: called with the arguments as keyword arguments."""

    def __init__(self, fn: Callable, *, name: str, schema: dict):
        super().__init__(name=name, schema=schema)
        self.fn = fn

    async def execute(self, arguments: dict) -> str:
        out = self.fn(**arguments)
        if inspect.isawaitable(out):
            out = await out
        return str(out)


def _schema_for(fn: Callable, name: str) -> dict:
    params = {p: {"type": "string"} for p in inspect.signature(fn).parameters}
    return {"type": "function", "function": {
        "name": name, "description": (fn.__doc__ or "").strip().split("\n")[0],
        "parameters": {"type": "object", "properties": params, "required": list(params)}}}


def tool_from_function(fn: Callable, *, name: Optional[str] = None,
                       schema: Optional[dict] = None) -> Tool:
    name = name or fn.__name__
    return FunctionTool(fn, name=name, schema=schema or _schema_for(fn, name))


def register_tool(name: str):
    """Decorator: register a Tool subclass or a plain function under `name` (a class_name the tool
    config may use)."""

    def deco(obj):
        if name in _REGISTRY:
            raise ValueError(f"tool {name!r} is already registered")
        if inspect.isclass(obj) and issubclass(obj, Tool):
            _REGISTRY[name] = obj
        elif callable(obj):
            _REGISTRY[name] = lambda *, name, schema, **kw: FunctionTool(obj, name=name,
                                                                         schema=schema)
        else:
            raise TypeError(f"register_tool({name!r}) takes a Tool subclass or a function")
        return obj

    return deco
