"""Tools for multi-turn rollouts: a registry, verl's tool-config format, and the shipped tools.

A tool is either a plain Python function (`register_tool("name")(fn)`, called with the call's
arguments as keyword arguments, returning text) or a class with `async execute(arguments: dict)`
returning text (the shape of verl's `BaseTool.execute`, without the instance bookkeeping), built
from its config dict. The tool config file (rollout.multi_turn.tool_config_path) is verl's YAML:

    tools:
      - class_name: hybridflow.tools.code.CodeInterpreter   # a dotted path or a registered name
        config: {timeout_s: 5, memory_mb: 1024}
        tool_schema:                                        # OpenAI function schema
          type: function
          function: {name: code_interpreter, description: ..., parameters: {...}}

Shipped: `code_interpreter` (hybridflow/tools/code.py: a sandboxed Python process per call) and
`calculator` (hybridflow/tools/calculator.py: safe AST evaluation of arithmetic).
"""

from hybridflow.tools.base import Tool, ToolCall, ToolOutcome, register_tool, tool_from_function
from hybridflow.tools.config import get_tool_class, load_tool_config

__all__ = ["Tool", "ToolCall", "ToolOutcome", "get_tool_class", "load_tool_config",
           "register_tool", "tool_from_function"]
