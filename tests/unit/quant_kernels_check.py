"""Run under TRITON_INTERPRET=1 (tests/unit/test_quantized_rollout.py starts it): the quantized
rollout's Triton kernels against their PyTorch twins on CPU (fp32), and a greedy generation with
int4 weights through the fused decode kernels against the torch path. Prints one JSON line."""

import json

import torch

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.kernels import quant as kq
from hybridflow.kernels.quant import config_for, quant_rows_fp8
from hybridflow.rollout import Generator
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.quantize import quantize
from tests.unit.test_rollout import PROMPTS, random_params
from tests.unit.triton_interp import patch

patch()

out = {"int4": [], "fp8_rows": [], "generate": [], "dequant": []}
g = torch.Generator().manual_seed(0)
# (M, N, K): one row, odd rows and columns (masked tiles), K split over programs (the last: 7
# groups in 4 splits of 2, the last one short), each row-tile size (16, 32, 64); more rows than
# kq.KERNEL_MAX_ROWS: int4 through the dequantized weight, fp8 weight-only in two row tiles
for M, N, K in ((1, 64, 128), (5, 96, 384), (20, 64, 256), (33, 200, 640), (64, 64, 1280),
                (2, 2816, 896), (300, 96, 384)):
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g)
    b, r = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    q, q8 = quantize(w, "int4"), quantize(w, "fp8")
    case = {"shape": [M, N, K], "split": config_for(M, N, K).split_k, "err": 0.0,
            "dequantized": M > kq.KERNEL_MAX_ROWS}
    for name, fn, args in (("int4", kq.int4_linear, (q.codes, q.scales, q.mins)),
                           ("fp8", kq.fp8_weight_only_linear, (q8.codes, q8.scales))):
        # plain, + bias, + bias into a residual (in place)
        for kw in ({}, {"bias": b}, {"bias": b, "residual": r}):
            ref_kw = dict(kw, residual=r.clone()) if "residual" in kw else kw
            got_kw = dict(kw, residual=r.clone()) if "residual" in kw else kw
            ref = fn(x, *args, impl="torch", **ref_kw)
            got = fn(x, *args, impl="triton", **got_kw)
            if M == 33:  # other tiles (probe_quant_gemm.py --sweep's): the same values
                other = kq.Config(block_m=16, block_n=32, block_k=64, split_k=2, warps=4,
                                  stages=3)
                alt_kw = dict(kw, residual=r.clone()) if "residual" in kw else kw
                alt = fn(x, *args, impl="triton", config=other, **alt_kw)
                case["err"] = max(case["err"], float((alt - ref).abs().max() / ref.abs().max()))
            if "residual" in kw:
                case["in_place"] = case.get("in_place", True) and got is got_kw["residual"]
            case["err"] = max(case["err"], float((got - ref).abs().max() / ref.abs().max()))
    out["int4"].append(case)
# the int4 dequantization kernel: the twin's bits (fp32 here: the interpreter truncates to bf16
# where torch and the GPU round to nearest; tests/gpu checks bf16)
for N, K, dtype in ((64, 128, torch.float32), (100, 384, torch.float32)):
    q = quantize(torch.randn(N, K, generator=g).to(dtype), "int4")
    ref = kq.dequantize_int4(q.codes, q.scales, q.mins)
    got = kq.dequantize_int4(q.codes, q.scales, q.mins, impl="triton")
    out["dequant"].append({"shape": [N, K], "dtype": str(dtype),
                           "equal": bool(torch.equal(got, ref))})
# rows whose values are e4m3 numbers times a power of two, the row's amax 448 of them: x / scale
# is exact, so the codes need no rounding (the interpreter's fp8 rounding is not the GPU's)
for M, K in ((1, 16), (7, 96), (4, 1000)):
    codes = torch.randn(M, K, generator=g).mul(60).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes[:, 0] = 448.0
    x = codes.float() * torch.tensor([2.0 ** (i % 5 - 2) for i in range(M)])[:, None]
    c_ref, s_ref = quant_rows_fp8(x, impl="torch")
    c, s = quant_rows_fp8(x, impl="triton")
    out["fp8_rows"].append({"shape": [M, K], "scales_equal": bool(torch.equal(s, s_ref)),
                            "codes_equal": bool(torch.equal(c.float(), c_ref.float()))})

cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, vocab_size=37, add_qkv_bias=True)
params = random_params(cfg)
rc = RolloutConfig(max_new_tokens=6, temperature=0.0, return_logprobs=True, max_batch_size=8)
# int4, and fp8 with the decode's GEMMs weight-only (the interpreter's E4M3 rounding of the
# activations is not the GPU's: tests/gpu covers fp8 through _scaled_mm under the kernels)
for mode, wo_rows in (("int4", 0), ("fp8", 1 << 20)):
    runs = {}
    for kernels in ("torch", "triton"):
        gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=torch.device("cpu"),
                        dtype=torch.float32, true_vocab_size=cfg.vocab_size, quantization=mode)
        opts = DecodeOptions.from_config(rc).replace(kernels=kernels, swiglu_gemm_min_rows=1,
                                                     fp8_weight_only_max_rows=wo_rows)
        runs[kernels] = gen.generate(PROMPTS, cfg=rc, eos_id=36, pad_id=0, seed=3, options=opts)
    a, b = runs["torch"], runs["triton"]
    out["generate"].append({"mode": mode,
                            "tokens_equal": bool(torch.equal(a.response_ids, b.response_ids)),
                            "lp_err": float((a.rollout_logprobs - b.rollout_logprobs).abs().max())})
print(json.dumps(out))
