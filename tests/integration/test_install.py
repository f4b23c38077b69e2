"""The package is self-contained: conf/ and kernels/ resolve as `hybridflow.conf` and
`hybridflow.kernels` in all three ways of running it, from a directory that is not the checkout.

- wheel: `pip wheel --no-deps --no-build-isolation` of a copy of the checkout, installed (--no-deps)
  into a fresh venv; `hybridflow-train --cfg` and a 2-step tiny run work with PYTHONPATH cleared;
- source checkout: the copy on PYTHONPATH, nothing installed;
- editable install: `pip install -e` of the copy, with and without PYTHONPATH=<copy> (as the launch
  scripts run it).
In each, the config, the kernels and the cost model's model list must come from that copy or that
install, not from another checkout. The venvs are created with --system-site-packages on this
interpreter, and a .pth line adds this venv's site-packages (a venv's --system-site-packages means the
base interpreter's, which lacks torch and megatron here): nothing is downloaded or reinstalled.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # builds a wheel and venvs, and runs a training in each

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "hybridflow")

# prints where the three resources came from, and what they hold
PROBE = """
import json, hybridflow, hybridflow.conf, hybridflow.kernels.logprob_entropy as k
from hybridflow.config import load_config
from hybridflow.cost.shapes import known_models
print(json.dumps({"package": hybridflow.__file__, "conf": hybridflow.conf.__file__,
                  "kernels": k.__file__, "models": known_models(),
                  "model": load_config(["experiment=demo", "model=qwen2_0_5b"]).model.name}))
"""


def _copy_checkout(dst: Path) -> Path:
    dst.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.pyc")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, symlinks=True, ignore=skip)
        else:
            shutil.copy2(src, dst / name)
    return dst


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(path)], check=True, timeout=120)
    py = path / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    parent = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    # plain path lines: the parent's own .pth files (its editable hybridflow finder) are not run
    Path(site, "_hybridflow_test_parent.pth").write_text("\n".join(parent) + "\n")
    return py


def _run(cmd: list, *, cwd: Path, pythonpath: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _pip(py: Path, *args) -> None:
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
          "--disable-pip-version-check", *args], cwd=py.parent)


def _probe(py: Path, *, cwd: Path, pythonpath: Path | None = None) -> dict:
    return json.loads(_run([py, "-c", PROBE], cwd=cwd, pythonpath=pythonpath).splitlines()[-1])


def _assert_from(found: dict, where: Path) -> None:
    for key in ("package", "conf", "kernels"):
        assert Path(os.path.realpath(found[key])).is_relative_to(os.path.realpath(where)), (key, found)
    assert found["models"] == sorted(p.stem for p in (ROOT / "hybridflow" / "conf" / "model").glob("*.yaml"))
    assert found["model"] == "qwen2_0_5b"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return _copy_checkout(tmp_path_factory.mktemp("checkout") / "src")


def test_wheel_runs_from_any_directory(checkout, tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-w", wheels, checkout], cwd=tmp_path)
    (wheel,) = wheels.glob("hybridflow-*.whl")
    py = _venv(tmp_path / "venv")
    _pip(py, "--ignore-installed", wheel)  # --ignore-installed: never touch this venv's hybridflow
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    _assert_from(_probe(py, cwd=cwd), tmp_path / "venv")
    train = tmp_path / "venv" / "bin" / "hybridflow-train"
    cfg = json.loads(_run([train, "--cfg", "experiment=demo"], cwd=cwd))
    tiny = yaml.safe_load((ROOT / "hybridflow" / "conf" / "model" / "tiny.yaml").read_text())
    assert {k: cfg["model"][k] for k in tiny} == tiny
    _run([train, "experiment=demo", "trainer.total_steps=2", "trainer.sft_warmup_steps=0", "trainer.output_dir=out",
          "trainer.progress_bar=false", "trainer.tensorboard=false"], cwd=cwd)
    lines = (cwd / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2]


def test_source_checkout_and_editable_install(checkout, tmp_path):
    py = _venv(tmp_path / "venv")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    _assert_from(_probe(py, cwd=cwd, pythonpath=checkout), checkout)  # nothing installed
    _pip(py, "-e", checkout)
    _assert_from(_probe(py, cwd=cwd), checkout)
    _assert_from(_probe(py, cwd=cwd, pythonpath=checkout), checkout)
    cfg = json.loads(_run([tmp_path / "venv" / "bin" / "hybridflow-train", "--cfg", "experiment=demo", "model=qwen2_7b"],
                          cwd=cwd))
    assert cfg["model"]["num_layers"] == 28
