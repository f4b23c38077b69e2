"""benchmarks/compare_kernels.py: a trainer profile's stage against a bench pass, kernel by kernel."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compare_kernels  # noqa: E402

GEMM = "nvjet_sm90_tst_128x272_64x4_1x2_h_bz_coopA_NNT"
NORM = "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16>"


def _files(tmp_path):
    prof = {"step": 3, "stages": {"update_actor": {"top": [
        {"kernel": GEMM, "s": 0.110, "calls": 240}, {"kernel": NORM, "s": 0.040, "calls": 490},
        {"kernel": "_trainer_only_kernel", "s": 0.005, "calls": 10}]}}}
    bench = {"results": {"packed_fa4": {"update_top_kernels": {"top": [
        {"name": GEMM, "cuda_s": 0.100, "calls": 240}, {"name": NORM, "cuda_s": 0.040, "calls": 490},
        {"name": "_bench_only_kernel", "cuda_s": 0.002, "calls": 5}]}}}}
    json.dump(prof, open(tmp_path / "prof.json", "w"))
    json.dump(bench, open(tmp_path / "bench.json", "w"))
    return f"{tmp_path / 'prof.json'}:update_actor", f"{tmp_path / 'bench.json'}:packed_fa4/update"


def test_gemms_and_the_rest_are_compared_on_the_kernels_both_list(tmp_path):
    a, b = _files(tmp_path)
    out = compare_kernels.main(["--a", a, "--b", b, "--out", str(tmp_path / "c.json")])
    assert out["both"]["gemm"]["b_over_a"] == pytest.approx(0.100 / 0.110)
    assert out["both"]["other"]["b_over_a"] == pytest.approx(1.0)  # the norm kernel: level
    assert [r["kernel"] for r in out["kernels"]] == [GEMM[:60], NORM[:60]]
    assert [r["kernel"] for r in out["a_only"]] == ["_trainer_only_kernel"]
    assert [r["kernel"] for r in out["b_only"]] == ["_bench_only_kernel"]
    assert json.load(open(tmp_path / "c.json"))["both"]["gemm"]["a_s"] == pytest.approx(0.110)


def test_flash_attention_is_not_counted_as_a_gemm():
    assert compare_kernels.is_gemm(GEMM) and not compare_kernels.is_gemm(NORM)
    assert not compare_kernels.is_gemm("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90")


def test_a_missing_stage_or_variant_names_what_is_there(tmp_path):
    a, b = _files(tmp_path)
    with pytest.raises(SystemExit, match=r"no stage 'ref' \(has \['update_actor'\]\)"):
        compare_kernels.load_side(a.replace("update_actor", "ref"))
    with pytest.raises(SystemExit, match=r"no ref_top_kernels for variant 'packed_fa4'"):
        compare_kernels.load_side(b.replace("/update", "/ref"))
    with pytest.raises(SystemExit, match="expected FILE:WHERE"):
        compare_kernels.load_side("just_a_file.json")
