"""verl's tool-config YAML -> Tool instances: class names resolved through the registry (the shipped
tools register themselves on import) or as dotted paths; errors name the file and the key."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Callable

from hybridflow.tools import calculator, code  # noqa: F401  (they register themselves)
from hybridflow.tools.base import _REGISTRY, FunctionTool, Tool


def get_tool_class(class_name: str) -> Callable[..., Tool]:
    """A registered name, or `module.Class` / `module.function` (a dotted path)."""
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
