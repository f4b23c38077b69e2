"""Generate docs/options.md, the options reference, from the typed config schema.

    python docs/gen_options.py > docs/options.md     # write it
    python docs/gen_options.py --check               # exit 1 if docs/options.md is stale

Walks the dataclasses under `hybridflow.config.Config` (and any dataclass nested in them) and prints
one table per group: dotted key, type, default, description. Defaults are read from a `Config()`
instance, so `default_factory` values come out as they are built. Descriptions are the source's
comments: a field's inline `#` comment and the comment lines right above it (no blank line between).
A comment block that directly follows a field with an inline comment, when the next field has an
inline comment of its own, continues the first field's comment (`fn: ... = "default"  # a, b;` /
`# null: ...` / `model_path: ...  # ...`). Nothing here names a field: new fields and groups appear
when the schema grows.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import tokenize
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "options.md"
FIX = "python docs/gen_options.py > docs/options.md"


@lru_cache(maxsize=None)
def _source(path: str) -> tuple[ast.Module, dict[int, str], frozenset[int]]:
    """The parsed file, its comments by line, and the lines that hold code."""
    text = Path(path).read_text()
    comments: dict[int, str] = {}
    code: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
        elif tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return ast.parse(text), comments, frozenset(code)


def _clean(comment: str) -> str:
    text = comment.lstrip("#").strip()
    return "" if re.fullmatch(r"[-=_*~# ]*", text) else text  # separator lines say nothing


def _join(lines: list[str]) -> str:
    """Comment lines as one text; a word hyphenated across lines is joined again."""
    text = ""
    for line in filter(None, lines):
        if re.search(r"\w-$", text) and line[:1].islower():
            text += line
        else:
            text = f"{text} {line}" if text else line
    return text


def _sentence(first: str, second: str) -> str:
    """Two comments of one field: the block above, then the inline one."""
    if not first or not second:
        return first or second
    return f"{first} {second}" if first[-1] in ".;:," else f"{first}; {second}"


def _class_comments(cls: type) -> dict[str, str]:
    """Field name -> its description from the comments of `cls`'s own source."""
    path = inspect.getsourcefile(cls)
    if path is None:
        return {}
    tree, comments, code = _source(path)
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__),
                None)
    if node is None:
        return {}
    fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    inline, above, follows_prev = {}, {}, {}
    prev_end = None
    for s in fields:
        name = s.target.id
        inline[name] = _join([_clean(comments[ln]) for ln in range(s.lineno, s.end_lineno + 1)
                              if ln in comments and ln in code])
        block, ln = [], s.lineno - 1
        while ln in comments and ln not in code:
            block.insert(0, _clean(comments[ln]))
            ln -= 1
        above[name] = _join(block)
        follows_prev[name] = prev_end is not None and ln == prev_end and bool(block)
        prev_end = s.end_lineno
    out = {}
    names = [s.target.id for s in fields]
    for i, name in enumerate(names):
        lead = above[name]
        if lead and follows_prev[name] and inline[name] and i > 0 and inline[names[i - 1]]:
            out[names[i - 1]] = _sentence(out[names[i - 1]], lead)
            lead = ""
        out[name] = _sentence(lead, inline[name])
    return out


def _comments_for(cls: type) -> dict[str, str]:
    merged: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        if dataclasses.is_dataclass(base):
            merged.update(_class_comments(base))
    return merged


def _escape(text: str) -> str:
    """Markdown table cell: pipes escaped everywhere, `<` outside code spans."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return json.dumps(v)
    return repr(v)


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("typing.", "")


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    # dataclasses give undocumented classes a signature as their docstring: not a description
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def _sections(obj, prefix: str):
    """(key, class, rows) for `obj` and, depth first, for every nested dataclass instance."""
    cls = type(obj)
    notes = _comments_for(cls)
    rows, nested = [], []
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            rows.append((key, type(v).__name__, None, notes.get(f.name, "")))
            nested.append((v, key))
        else:
            rows.append((key, _type(f), _value(v), notes.get(f.name, "")))
    yield prefix, cls, rows
    for v, key in nested:
        yield from _sections(v, key)


def _relpath(cls: type) -> str:
    path = inspect.getsourcefile(cls) or ""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from hybridflow.config import Config

    lines = [
        "# Options reference",
        "",
        "<!-- Generated by docs/gen_options.py from the config schema: do not edit by hand. -->",
        f"Generated from the typed schema (`{_relpath(Config)}` and the dataclasses it nests) by "
        f"[`gen_options.py`](gen_options.py): `{FIX}`. Every key is set as a Hydra override "
        "(`algo.kl_loss_coef=0.002`) or in a YAML file under `hybridflow/conf/`. Defaults are the "
        "schema's; the groups that `hybridflow/conf/ppo.yaml` selects (model, algo, parallel, "
        "experiment) set values over them, and `--cfg` prints the composed result. A `null` speed "
        "option is decided for the device at start-up (`hybridflow/config_auto.py`).",
    ]
    for key, cls, rows in _sections(Config(), ""):
        title = f"`{key}`" if key else "Top level"
        lines += ["", f"## {title}", "", f"`{cls.__name__}` in `{_relpath(cls)}`."]
        doc = _doc(cls)
        if doc and key:
            lines += ["", _escape(doc)]
        lines += ["", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        for k, t, d, desc in rows:
            default = f"`{_escape(d)}`" if d is not None else f"table `{k}` below"
            lines.append(f"| `{k}` | `{_escape(t)}` | {default} | {_escape(desc)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 if {OUT.relative_to(ROOT)} differs from what this would write")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run `{FIX}`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
