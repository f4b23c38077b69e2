"""`calculator`: arithmetic on numbers by safe AST evaluation (no names, calls or attributes)."""

from __future__ import annotations

import ast
import math
import operator

from hybridflow.tools.base import Tool, register_tool

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil}
MAX_POWER = 1000  # exponents beyond it are refused (2 ** 10 ** 9 would hang the worker)


def evaluate(expression: str):
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses and
    sqrt/abs/round/floor/ceil. Anything else raises ValueError."""
    tree = ast.parse(expression.strip(), mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
                raise ValueError(f"exponent {right} is too large (at most {MAX_POWER})")
            return _BIN[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
            return _UN[type(node.op)](ev(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _FUNCS and not node.keywords):
            return _FUNCS[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(f"unsupported expression element {ast.dump(node)[:60]}")

    return ev(tree)


@register_tool("calculator")
class Calculator(Tool):
    """arguments {"expression": "3 * (4 + 5)"} -> "27"."""

    async def execute(self, arguments: dict) -> str:
        expr = arguments.get("expression")
        if not isinstance(expr, str):
            raise ValueError("calculator needs a string argument 'expression'")
        value = evaluate(expr)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
            value = int(value)
        return str(value)
