"""One decode GEMM alone per quantization mode, at the Qwen2 0.5B / 1.5B layer shapes (qkv, proj, fc1,
fc2) and 64 / 256 rows: bf16 F.linear (cuBLAS), our int4 and fp8 paths (rollout/quantize.linear:
the int4 Triton kernel, _scaled_mm with per-token activation quantization, the fp8 weight-only
Triton kernel) and torch's tinygemm int4 kernel (torch._weight_int4pack_mm, the one torchao's
int4 weight-only layout calls), fed our int4 codes (w = q * scale + min -> tinygemm's scale and
zero) with its error against our dequantized product. Milliseconds by triton.testing.do_bench
(eager launches: our Triton kernels carry their launch cost here, which a decode step's CUDA
graph does not), and each GEMM's bf16 weight-read floor at 4.8 TB/s.

  python benchmarks/probe_quant_gemm.py --out benchmarks/results/quant_gemm_probe_h200.json   # one H200, ~30 s
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from triton.testing import do_bench

    from hybridflow.rollout.quantize import linear, quantize

    torch.manual_seed(0)
    res = {}
    for model, mats in SHAPES.items():
        for name, (n, k) in mats.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q4, q8 = quantize(w, "int4"), quantize(w, "fp8")
            tw, sz = to_tinygemm(q4)
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, q4.dequantize().to(torch.bfloat16)).float()
                tiny = torch._weight_int4pack_mm(x, tw, 128, sz).float()
                r = {"bf16": do_bench(lambda: F.linear(x, w)),
                     "int4_ours": do_bench(lambda: linear(x, q4)),
                     "fp8": do_bench(lambda: linear(x, q8)),
                     "fp8_weight_only": do_bench(lambda: linear(x, q8, fp8_weight_only_max_rows=1 << 20)),
                     "tinygemm_int4": do_bench(lambda: torch._weight_int4pack_mm(x, tw, 128, sz)),
                     "tinygemm_rel_err": float((tiny - ref).abs().max() / ref.abs().max()),
                     "bf16_floor": (n * k * 2 + m * (n + k) * 2) / 4.8e12 * 1e3}
                res[f"{model}/{name}/{m}"] = {a: round(b, 4) for a, b in r.items()}
                print(model, name, m, res[f"{model}/{name}/{m}"], flush=True)
    out = {"benchmark": "one decode GEMM per quantization mode (ms, do_bench, eager launches)",
           "machine": machine(), "versions": versions("torch", "triton"), "command": command(),
           "results": res}
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
