"""One decode GEMM alone per quantization mode, at the Qwen2 0.5B / 1.5B layer shapes (qkv, proj, fc1,
fc2) and 64 / 256 rows: bf16 F.linear (cuBLAS), our int4 and fp8 paths (rollout/quantize.linear:
the int4 Triton kernel, _scaled_mm with per-token activation quantization, the fp8 weight-only
Triton kernel) and torch's tinygemm int4 kernel (torch._weight_int4pack_mm, the one torchao's
int4 weight-only layout calls), fed our int4 codes (w = q * scale + min -> tinygemm's scale and
zero) with its error against our dequantized product. Milliseconds by triton.testing.do_bench
(eager launches: our Triton kernels carry their launch cost here, which a decode step's CUDA
graph does not), and each GEMM's bf16 weight-read floor at 4.8 TB/s. With --graphs every
timing replays a CUDA graph of the call (triton.testing.do_bench_cudagraph: no launch cost, as in
the decode). With --sweep also the weight-only kernels (int4, fp8) at a grid of tiles
(kernels.quant.Config: 16-64-row tiles, 32-128 columns, 32- or 64-column K steps, 4 or 8 warps,
K split as config_for splits): per GEMM the default's time, the best tiles and theirs, to choose
config_for's. With --gemlite also gemlite's Triton kernels (A16W4 fed our int4 codes, scales and
offsets; A16W8 fp8 weight-only; A8W8 fp8 with dynamic activation scales), each product's error
against ours.

  python benchmarks/probe_quant_gemm.py --out benchmarks/results/quant_gemm_probe_h200.json   # one H200, ~30 s
  python benchmarks/probe_quant_gemm.py --graphs --sweep --rows 1 64 --out ...              # ~2 min
  python benchmarks/probe_quant_gemm.py --graphs --gemlite --rows 64 256 --out ...  # ~6 min
(gemlite autotunes each shape at first call; its 1-row int4 kernel hit an illegal memory access
on an H100, so no 1-row GEMMs with --gemlite.)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402

SHAPES = {"qwen2_0_5b": dict(qkv=(1152, 896), proj=(896, 896), fc1=(9728, 896), fc2=(896, 4864)),
          "qwen2_1_5b": dict(qkv=(2048, 1536), proj=(1536, 1536), fc1=(17920, 1536),
                             fc2=(1536, 8960))}


def to_tinygemm(q, tiles: int = 8):
    """Our int4 QuantWeight -> (tinygemm's packed weight, its (K / 128, N, 2) scales and zeros)."""
    n, kw = q.codes.shape
    shifts = torch.arange(0, 32, 4, device=q.codes.device, dtype=torch.int32)
    codes = ((q.codes[..., None] >> shifts) & 15).view(n, kw * 8).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(),
                                               tiles)
    scale = q.scales.to(torch.bfloat16)
    zero = (q.mins.float() + 8 * q.scales.float()).to(torch.bfloat16)  # tinygemm: (q - 8) s + z
    return packed, torch.stack([scale.t(), zero.t()], -1).contiguous()


def gemlite_linears(q4, w) -> dict:
    """gemlite layers for the same weight: {"gemlite_int4": A16W4 from our int4 codes (w = q * scale
    + min, gemlite's fma form: zeros = -min / scale), "gemlite_fp8_weight_only": A16W8 fp8
    channel-wise, "gemlite_fp8_dynamic": A8W8 fp8 with per-token activation scales}."""
    from gemlite.helper import A8W8_fp8_dynamic, A16W4_HQQ_INT, A16W8_FP8

    n, kw = q4.codes.shape
    shifts = torch.arange(0, 32, 4, device=q4.codes.device, dtype=torch.int32)
    codes = ((q4.codes[..., None] >> shifts) & 15).view(n, kw * 8).to(torch.uint8)
    zeros = -q4.mins.float() / q4.scales.float()
    dev, dt = w.device, w.dtype
    return {"gemlite_int4": A16W4_HQQ_INT(device=dev, dtype=dt).from_weights(codes, q4.scales,
                                                                             zeros),
            "gemlite_fp8_weight_only": A16W8_FP8(device=dev, dtype=dt).from_weights(w.clone()),
            "gemlite_fp8_dynamic": A8W8_fp8_dynamic(device=dev, dtype=dt).from_weights(w.clone())}


def sweep(bench, kq, x, q4, q8, ref) -> dict:
    """The weight-only kernels at a grid of tiles: {mode: {"default": [tiles, ms], "best": [tiles,
    ms]}}, each product checked against the dequantized one (int4; fp8 against its own default)."""
    import itertools

    (m, k), n = x.shape, q4.codes.shape[0]
    default = kq.config_for(m, n, k)
    block_ms = sorted({b for b in (16, 32, 64) if b >= min(m, 64) or b == 64})[:2]
    out = {}
    for mode, fn, args in (("int4", kq.int4_linear, (q4.codes, q4.scales, q4.mins)),
                           ("fp8_weight_only", kq.fp8_weight_only_linear, (q8.codes, q8.scales))):
        want = fn(x, *args).float() if mode != "int4" else ref
        timed = {}
        for bm, bn, bk, warps in itertools.product(block_ms, (32, 64, 128), (32, 64), (4, 8)):
            cfg = kq.Config(bm, bn, bk, kq.split_for(m, n, k, bm, bn), warps, default.stages)
            got = fn(x, *args, config=cfg).float()
            if (got - want).abs().max() > 2 ** -7 * want.abs().max() + 1e-3:
                raise AssertionError(f"{mode} {cfg}: wrong product")
            timed[cfg] = bench(lambda: fn(x, *args, config=cfg))
        best = min(timed, key=timed.get)
        out[mode] = {"default": [list(default), round(bench(lambda: fn(x, *args)), 4)],
                     "best": [list(best), round(timed[best], 4)]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of each call")
    ap.add_argument("--sweep", action="store_true", help="the weight-only kernels' tiles too")
    ap.add_argument("--gemlite", action="store_true", help="gemlite's kernels beside ours")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from triton.testing import do_bench, do_bench_cudagraph

    from hybridflow.kernels import quant as kq
    from hybridflow.rollout.quantize import linear, quantize

    bench = do_bench_cudagraph if args.graphs else do_bench

    torch.manual_seed(0)
    res = {}
    how = "CUDA-graph replays" if args.graphs else "eager launches"
    out = {"benchmark": f"one decode GEMM per quantization mode (ms, do_bench, {how})",
           "machine": machine(),
           "versions": versions("torch", "triton", *(["gemlite"] if args.gemlite else [])),
           "command": command(), "results": res}
    for model, mats in SHAPES.items():
        for name, (n, k) in mats.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q4, q8 = quantize(w, "int4"), quantize(w, "fp8")
            tw, sz = to_tinygemm(q4)
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, q4.dequantize().to(torch.bfloat16)).float()
                tiny = torch._weight_int4pack_mm(x, tw, 128, sz).float()
                r = {"bf16": bench(lambda: F.linear(x, w)),
                     "int4_ours": bench(lambda: linear(x, q4)),
                     "fp8": bench(lambda: linear(x, q8)),
                     "fp8_weight_only": bench(
                         lambda: linear(x, q8, fp8_weight_only_max_rows=1 << 20)),
                     "tinygemm_int4": bench(lambda: torch._weight_int4pack_mm(x, tw, 128, sz)),
                     "tinygemm_rel_err": float((tiny - ref).abs().max() / ref.abs().max()),
                     "bf16_floor": (n * k * 2 + m * (n + k) * 2) / 4.8e12 * 1e3}
                if args.gemlite:
                    for tag, layer in gemlite_linears(q4, w).items():
                        for _ in range(3):  # autotune and compile outside the timed graphs
                            got = layer(x).float()
                        torch.cuda.synchronize()
                        r[tag] = bench(lambda: layer(x))
                        ref_t = ref if tag == "gemlite_int4" else F.linear(x, w).float()
                        r[tag + "_rel_err"] = float((got - ref_t).abs().max() / ref_t.abs().max())
                res[f"{model}/{name}/{m}"] = {a: round(b, 4) for a, b in r.items()}
                if args.sweep and m <= kq.KERNEL_MAX_ROWS:
                    res[f"{model}/{name}/{m}"]["tiles"] = sweep(bench, kq, x, q4, q8, ref)
                print(model, name, m, res[f"{model}/{name}/{m}"], flush=True)
                write_json(args.out, {**out, "complete": False})  # if the call's limit ends it
    write_json(args.out, {**out, "complete": True})
    return out


if __name__ == "__main__":
    main()
