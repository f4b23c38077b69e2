"""The README and docs/ stay true to the code: the options reference is the schema's, the
module map (docs/architecture.md) names every module that exists (and nothing else), links resolve, the verl key
table names real keys, and the README stays a short product page."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_README_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a development diary has no place in the README: work sessions, tracker references, dates
DIARY = re.compile(r"\bsessions?\b|\bissues?\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def _gen_options():
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "docs" / "gen_options.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\b.*?(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, f"no '## {title}' section"
    return m.group(0)


def _tree_paths(text: str) -> set[str]:
    """Paths named by the first code block of `text` (a file tree, two spaces per level)."""
    block = re.search(r"```\n(.*?)```", text, re.DOTALL)
    assert block, "no file tree"
    paths, stack = set(), []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack = stack[:depth]
        paths.add("/".join(stack + [name.rstrip("/")]) + ("/" if name.endswith("/") else ""))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    return paths


def test_options_reference_is_generated_from_the_schema():
    want = _gen_options().render()
    have = (ROOT / "docs" / "options.md").read_text() if (ROOT / "docs" / "options.md").exists() else ""
    assert have == want, "docs/options.md is stale: run `python docs/gen_options.py > docs/options.md`"


def test_options_reference_has_every_schema_key():
    from hybridflow.config import Config

    text = (ROOT / "docs" / "options.md").read_text()

    def keys(obj, prefix=""):
        for f in dataclasses.fields(obj):
            key = f"{prefix}{f.name}"
            yield key
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                yield from keys(v, key + ".")

    missing = [k for k in keys(Config()) if f"| `{k}` |" not in text]
    assert not missing, f"docs/options.md lacks {missing}"


def test_architecture_tree_matches_the_package():
    pkg = ROOT / "hybridflow"
    modules = {p.relative_to(ROOT).as_posix() for p in pkg.rglob("*.py")
               if p.name != "__init__.py" and "__pycache__" not in p.parts}
    subpackages = {p.parent.relative_to(ROOT).as_posix() + "/" for p in pkg.rglob("__init__.py")
                   if p.parent != pkg}
    tree = _tree_paths(_section(ARCHITECTURE.read_text(), "Module map"))
    missing = sorted((modules | subpackages) - tree)
    assert not missing, f"docs/architecture.md's module map lacks {missing} (one line each)"
    gone = sorted(p for p in tree if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md's module map names {gone}, which do not exist"


def test_readme_map_names_every_subpackage_and_links_the_full_map():
    section = _section(README.read_text(), "Architecture")
    tree = _tree_paths(section)
    subpackages = {p.parent.relative_to(ROOT).as_posix() + "/"
                   for p in (ROOT / "hybridflow").rglob("__init__.py") if p.parent.parent == ROOT / "hybridflow"}
    assert not subpackages - tree, f"README.md's map lacks {sorted(subpackages - tree)}"
    gone = sorted(p for p in tree if not (ROOT / p).exists())
    assert not gone, f"README.md's map names {gone}, which do not exist"
    assert "(docs/architecture.md)" in section


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}): move detail "
                                   "to docs/")


def test_readme_is_not_a_diary():
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(README.read_text().splitlines(), 1)
            if DIARY.search(line)]
    assert not hits, "README.md reads like a work log (sessions, issues, dates):\n" + "\n".join(hits)


def test_relative_links_resolve():
    broken = []
    for md in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


def test_verl_key_table_names_real_keys():
    from hybridflow.config import Config

    section = _section(README.read_text(), "Config basics")
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    ours = [k for ln in rows if ln.count("|") == 3
            for k in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)`", ln.split("|")[2])]
    assert len(ours) >= 15, f"the verl -> hybridflow table names only {ours}"

    def exists(key: str) -> bool:
        obj = Config()
        for part in key.split("."):
            if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
                return False
            obj = getattr(obj, part)
        return True

    unknown = [k for k in ours if not exists(k)]
    assert not unknown, f"README's verl table names keys the schema lacks: {unknown}"


def test_readme_config_groups_exist():
    section = _section(README.read_text(), "Config basics")
    for group, cell in re.findall(r"^\| `(\w+)=` \| (.*) \|$", section, re.MULTILINE):
        for name in re.findall(r"`(\w+)`", cell.split("(random")[0]):
            assert (ROOT / "hybridflow" / "conf" / group / f"{name}.yaml").exists(), f"{group}={name}"
