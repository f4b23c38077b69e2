"""Module structure: no import cycles among hybridflow's modules, and only parallel/groups.py reads
Megatron's `parallel_state` (everything else receives a ParallelContext).

Imports are read with `ast` from the source (module level and inside functions alike: a cycle hidden
in a function-level import is still a cycle in the design).
"""

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "hybridflow")


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    tree = ast.parse(open(path).read())
    pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:  # the deepest module that exists
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name and not name.startswith(t + "."):  # a package's own __init__
                found.add(t)
    return found


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    # packages' __init__ re-exports are edges too; a module importing its own package is skipped
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_groups_reads_megatron_parallel_state():
    readers = []
    for name, path in _modules().items():
        src = open(path).read()
        if "parallel_state" in src and name not in ("hybridflow.parallel.groups",
                                                    "hybridflow.parallel._cpu_compat"):
            tree = ast.parse(src)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                    if any("parallel_state" in n for n in names):
                        readers.append(name)
    assert not readers, f"modules importing megatron's parallel_state: {sorted(set(readers))}"
