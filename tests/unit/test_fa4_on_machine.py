"""benchmarks/fa4_on_machine.sh: FlashAttention-4's wheels, carried in parts, installed into one
folder that imports (stand-in wheels with the real layout: the CUTLASS DSL's packages under
nvidia_cutlass_dsl/dsl_packages in a library wheel split in two)."""
import os
import subprocess
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fa4_on_machine.sh")


def _wheel(path, files: dict) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


def test_parts_and_wheels_install_into_one_importable_folder(tmp_path):
    wheels, src = tmp_path / "whl_fa4", tmp_path / "xfer_fa4"
    wheels.mkdir()
    src.mkdir()
    _wheel(wheels / "flash_attn_4-0-py3-none-any.whl",
           {"flash_attn/__init__.py": "", "flash_attn/cute/__init__.py": "import cutlass\n"})
    _wheel(wheels / "nvidia_cutlass_dsl_libs_core-0-py3-none-any.whl",
           {"nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": "CORE = 1\n"})
    libs = tmp_path / "libs.whl"  # the library wheel: larger than one call carries
    _wheel(libs, {"nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/__init__.py": "x = '" + "a" * 4096
                  + "'\n", "nvidia_cutlass_dsl/lib/libcute.so": "so"})
    data = libs.read_bytes()
    (src / "00").write_bytes(data[:len(data) // 2])
    (src / "01").write_bytes(data[len(data) // 2:])
    env = dict(os.environ, SITE=str(tmp_path / "site"), PARTS=str(tmp_path / "tmp" / "xfer_fa4"),
               SRC=str(src), WHEELS=str(wheels))
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", SCRIPT, "install"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "run 'part' in the call before" in r.stderr
    subprocess.run(["bash", SCRIPT, "part"], env=env, check=True, capture_output=True)
    r = subprocess.run(["bash", SCRIPT, "install"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "flash-attn-4 ready" in r.stdout
    site = tmp_path / "site"
    assert (site / "cutlass" / "_mlir" / "__init__.py").is_file()  # both wheels' halves, merged
    assert (tmp_path / "tmp" / "cutlass_dsl_libs.whl").read_bytes() == data
