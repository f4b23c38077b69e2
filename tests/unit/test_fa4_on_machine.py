"""benchmarks/fa4_on_machine.sh: FlashAttention-4's wheels, carried in parts, installed into one
folder that imports (stand-in wheels with the real layout: the CUTLASS DSL's packages under
nvidia_cutlass_dsl/dsl_packages in a library wheel split in three, one part carried per call)."""
import os
import shutil
import subprocess
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fa4_on_machine.sh")


def _wheel(path, files: dict) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


def test_parts_and_wheels_install_into_one_importable_folder(tmp_path):
    wheels, everything = tmp_path / "whl_fa4", tmp_path / "xfer_fa4"  # here: every part
    wheels.mkdir()
    everything.mkdir()
    _wheel(wheels / "flash_attn_4-0-py3-none-any.whl",
           {"flash_attn/__init__.py": "", "flash_attn/cute/__init__.py": "import cutlass\n"})
    _wheel(wheels / "nvidia_cutlass_dsl_libs_core-0-py3-none-any.whl",
           {"nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": "CORE = 1\n"})
    libs = tmp_path / "libs.whl"  # the library wheel: larger than one call carries
    _wheel(libs, {"nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/__init__.py": "x = '" + "a" * 4096
                  + "'\n", "nvidia_cutlass_dsl/lib/libcute.so": "so"})
    data = libs.read_bytes()
    third = len(data) // 3
    parts = [data[:third], data[third:2 * third], data[2 * third:]]
    carried = tmp_path / "carried"  # what one call carries to the machine
    for i, part in enumerate(parts):
        (everything / f"{i:02d}").write_bytes(part)
    env = dict(os.environ, SITE=str(tmp_path / "site"), PARTS=str(tmp_path / "tmp" / "xfer_fa4"),
               SRC=str(carried), WHEELS=str(wheels))
    env.pop("PYTHONPATH", None)

    def call(cmd, *names):
        shutil.rmtree(carried, ignore_errors=True)
        carried.mkdir()
        for n in names:
            shutil.copy(everything / n, carried / n)
        return subprocess.run(["bash", SCRIPT, cmd], env=env, capture_output=True, text=True)

    r = call("install")
    assert r.returncode == 1 and "run 'part' in a call before" in r.stderr
    r = call("part")
    assert r.returncode == 1 and "carry one with this call" in r.stderr
    assert call("part", "00").returncode == 0
    r = call("install", "02")  # 01 never carried
    assert r.returncode == 1 and "a part is missing" in r.stderr and "00 02" in r.stderr
    assert call("part", "01").returncode == 0
    r = call("install", "02")
    assert r.returncode == 0, r.stderr
    assert "flash-attn-4 ready" in r.stdout
    site = tmp_path / "site"
    assert (site / "cutlass" / "_mlir" / "__init__.py").is_file()  # both wheels' halves, merged
    assert (tmp_path / "tmp" / "cutlass_dsl_libs.whl").read_bytes() == data
