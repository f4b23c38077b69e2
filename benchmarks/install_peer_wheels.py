"""Install carried peer-baseline wheels (TRL, datasets, ...) into a folder, filling only missing deps.

The GPU machine has no network. Its image has torch, transformers, accelerate, pandas, pyarrow, ...
but not TRL and its data stack. WHEELS/*.whl are always installed (unless the same version is there
already); WHEELS/fallback/*.whl only where a requirement of an installed wheel is not met by the
machine's own packages (nor by the target folder), repeated until nothing more can be filled. A
fallback thus never shadows a package the machine already has in a suitable version. Requirements no
wheel can meet are printed (a warning, exit 0: the import check that follows decides).

  python3 benchmarks/install_peer_wheels.py .whl_bench --target /tmp/site-packages
  export PYTHONPATH=/tmp/site-packages:$PWD
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def installed_version(name: str, paths: list[str]) -> str | None:
    dist = next(iter(md.distributions(name=name, path=paths)), None)
    if dist is None:  # distributions(name=) matches the normalised name on recent Pythons only
        want = canonicalize_name(name)
        dist = next((d for d in md.distributions(path=paths)
                     if canonicalize_name(d.metadata["Name"] or "") == want), None)
    return None if dist is None else dist.version


def pip_install(wheels: list[Path], target: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", target, *map(str, wheels)], check=True)


def unmet(target: str, paths: list[str], names: set[str]) -> list[Requirement]:
    """Requirements (no extras) of the distributions `names` in `target` that `paths` do not satisfy.

    Only the carried wheels' own requirements are checked: the folder may also hold other packages
    (megatron-core, hydra, ...) whose requirements are not ours to fill."""
    out = []
    for dist in md.distributions(path=[target]):
        if canonicalize_name(dist.metadata["Name"] or "") not in names:
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = installed_version(req.name, paths)
            if have is None or not req.specifier.contains(have, prereleases=True):
                out.append(req)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", help="folder with the wheels (and a fallback/ subfolder)")
    ap.add_argument("--target", default="/tmp/site-packages")
    args = ap.parse_args(argv)
    Path(args.target).mkdir(parents=True, exist_ok=True)
    paths = [args.target, *sys.path]

    core, names = [], set()
    for whl in sorted(Path(args.wheels).glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(whl.name)
        names.add(canonicalize_name(name))
        if installed_version(name, [args.target]) != str(version):
            core.append(whl)
    if core:
        pip_install(core, args.target)
    print("installed:", ", ".join(w.name for w in core) or "nothing new")

    fallback = {}
    for whl in sorted(Path(args.wheels, "fallback").glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(whl.name)
        fallback[canonicalize_name(name)] = (version, whl)
    tried = set()
    while True:
        fill, missing = [], []
        for req in unmet(args.target, paths, names):
            name = canonicalize_name(req.name)
            version, whl = fallback.get(name, (None, None))
            if whl is not None and name not in tried and req.specifier.contains(version, prereleases=True):
                fill.append(whl)
                tried.add(name)
                names.add(name)
            elif re.sub(r"\s", "", str(req)) not in missing:
                missing.append(re.sub(r"\s", "", str(req)))
        if not fill:
            break
        pip_install(fill, args.target)
        print("filled missing deps:", ", ".join(w.name for w in fill))
    for req in missing:
        have = installed_version(Requirement(req).name, paths)
        print(f"warning: requirement {req} not met (have {have}); no carried wheel fits", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
