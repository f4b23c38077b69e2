"""The tool registry, the Tool interface and verl's tool-config YAML (see hybridflow/tools/__init__)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
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
            text = asyncio.run(self.execute(dict(call.arguments)))
            out = ToolOutcome(text=str(text))
        except ToolTimeout as e:
            out = ToolOutcome(text=f"Error: {e}", error=True, timeout=True)
        except Exception as e:  # noqa: BLE001 - reported to the model, counted in tool_errors
            out = ToolOutcome(text=f"Error: {type(e).__name__}: {e}", error=True)
        out.seconds = time.perf_counter() - t0
        return out


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


def get_tool_class(class_name: str) -> Callable[..., Tool]:
    """A registered name, or `module.Class` / `module.function` (a dotted path)."""
    _ensure_builtins()
    if class_name in _REGISTRY:
        return _REGISTRY[class_name]
    module, _, attr = class_name.rpartition(".")
    if not module:
        raise ValueError(f"unknown tool class_name {class_name!r}: expected one of "
                         f"{sorted(_REGISTRY)} or a dotted path module.Class")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool class_name {class_name!r} does not import: {e}") from e
    if inspect.isclass(obj) and issubclass(obj, Tool):
        return obj
    if callable(obj):
        return lambda *, name, schema, **kw: FunctionTool(obj, name=name, schema=schema)
    raise ValueError(f"tool class_name {class_name!r} is neither a Tool subclass nor a function")


def _ensure_builtins() -> None:
    from hybridflow.tools import calculator, code  # noqa: F401  (they register themselves)


def load_tool_config(path: str | Path) -> list[Tool]:
    """The tools of a verl tool-config YAML (a path, or the name of one shipped in
    hybridflow/tools/configs/: code_interpreter.yaml, calculator.yaml); errors name the file and
    the key."""
    import yaml

    path = Path(path).expanduser()
    shipped = Path(__file__).with_name("configs") / str(path)
    if not path.exists() and path.parent == Path(".") and shipped.is_file():
        path = shipped  # a shipped config by name (hybridflow/tools/configs/)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"rollout.multi_turn.tool_config_path={str(path)!r}: cannot read: {e}") \
            from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("tools"), list) or not doc["tools"]:
        raise ValueError(f"{path}: expected a top-level key 'tools' holding a non-empty list")
    tools, names = [], set()
    for i, entry in enumerate(doc["tools"]):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping with class_name, config, tool_schema")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected class_name, "
                             "config, tool_schema")
        if not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where}.class_name: expected a string (a dotted path or one of the "
                             "registered tools)")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}.config: expected a mapping, got {type(config).__name__}")
        schema = entry.get("tool_schema")
        fn = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(fn, dict) or schema.get("type") != "function":
            raise ValueError(f"{where}.tool_schema: expected {{type: function, function: {{name, "
                             "description, parameters}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.tool_schema.function.name: expected a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type") != "object":
            raise ValueError(f"{where}.tool_schema.function.parameters: expected a JSON schema "
                             "of type object")
        if name in names:
            raise ValueError(f"{where}.tool_schema.function.name: {name!r} is used twice")
        names.add(name)
        try:
            cls = get_tool_class(entry["class_name"])
        except ValueError as e:
            raise ValueError(f"{where}.class_name: {e}") from e
        try:
            tools.append(cls(name=name, schema=schema, **config))
        except TypeError as e:
            raise ValueError(f"{where}.config: {e}") from e
    return tools
