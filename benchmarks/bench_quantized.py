"""Quantized rollouts (rollout.quantization): generation time per mode (none = bf16, fp8, int4;
and fp8_weight_only: the fp8 codes without activation quantization,
rollout.kernel_options.fp8_weight_only_max_rows; kv_fp8: bf16 weights with rollout.kv_cache_dtype=fp8,
and fp8+kv_fp8 both) in one process, Qwen2-0.5B and Qwen2-1.5B shapes
(random init, bf16), 128-token prompts + 256 forced new tokens (no EOS), batch 64 and 256, the
product's GPU decode path (decode_kernels auto: the Triton kernels; CUDA graphs; the auto KV
window, an eighth of the cache). Each (mode, model, batch): one warm-up call (capture, Triton
compiles), then the median of --reps calls. Also each mode's read floor: per decode step the
weights it streams (quantized matrices + the bf16 LM head and norms) and the KV cache columns
written so far (bf16, or fp8 codes + scales), at --hbm-gbps.

    python benchmarks/bench_quantized.py --modes none kv_fp8 --batches 64 256 512 \
        --new-tokens 1024 --out benchmarks/results/kv_fp8_h200.json     # the fp8 KV cache

    python benchmarks/bench_quantized.py                                   # one H200, ~2-3 min
    python benchmarks/bench_quantized.py --device cpu --models small --batches 2 \\
        --prompt-len 8 --new-tokens 4 --reps 1 --out /tmp/q.json          # CPU smoke

Writes --out (default benchmarks/results/quantized_rollout_h200.json): `generation`
{mode: {model: {batch: seconds}}} (mode none as `bf16`), `floors` (same keys), `quantized_gb`
{mode: {model: GB}}, machine, versions, command; after every measurement, with `complete` false
until the last (a device call's limit keeps what was measured).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridflow.config import DecodeKernelOptions, ModelConfig, RolloutConfig  # noqa: E402
from hybridflow.rollout import Generator  # noqa: E402
from hybridflow.rollout.options import DecodeOptions  # noqa: E402
from hybridflow.rollout.quantize import MATRICES  # noqa: E402
from run_record import command, machine, versions, write_json  # noqa: E402

# --modes: (rollout.quantization, rollout.kv_cache_dtype)
MODES = {"none": ("none", "auto"), "fp8": ("fp8", "auto"), "fp8_weight_only": ("fp8", "auto"),
         "int4": ("int4", "auto"), "kv_fp8": ("none", "fp8"), "fp8+kv_fp8": ("fp8", "fp8")}
MODELS = {"qwen2_0_5b": "qwen2_0_5b.yaml", "qwen2_1_5b": "qwen2_1_5b.yaml", "small": "small.yaml"}
CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybridflow",
                    "conf", "model")


def random_params(cfg: ModelConfig, *, device, dtype) -> dict:
    """Megatron-named weights of `cfg` (PP = 1, TP = 1), N(0, 0.02), norms 1."""
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype) * 0.02  # noqa: E731
    D, hd = cfg.hidden_size, cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    G, H, F = cfg.num_query_groups, cfg.num_attention_heads, cfg.ffn_hidden_size
    ones = lambda n: torch.ones(n, device=device, dtype=dtype)  # noqa: E731
    p = {"embedding.word_embeddings.weight": r(cfg.vocab_size, D),
         "decoder.final_layernorm.weight": ones(D)}
    if not cfg.tie_word_embeddings:
        p["output_layer.weight"] = r(cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        q = f"decoder.layers.{i}."
        p[q + "input_layernorm.weight"] = ones(D)
        p[q + "pre_mlp_layernorm.weight"] = ones(D)
        p[q + "self_attention.linear_qkv.weight"] = r(G * (H // G + 2) * hd, D)
        if cfg.add_qkv_bias:
            p[q + "self_attention.linear_qkv.bias"] = r(G * (H // G + 2) * hd)
        p[q + "self_attention.linear_proj.weight"] = r(D, H * hd)
        p[q + "mlp.linear_fc1.weight"] = r(2 * F, D)
        p[q + "mlp.linear_fc2.weight"] = r(D, F)
    return p


def floor_s(gen: Generator, cfg: ModelConfig, *, B: int, P: int, R: int, gbps: float,
            kv_fp8: bool = False) -> float:
    """Seconds to read, per decode step, every weight the step streams (quantized matrices at their
    bytes, the rest in bf16) plus the K/V written so far (bf16, or fp8 codes + fp32 scales), at
    `gbps`."""
    w = gen.w
    matrices = sum(getattr(layer, f).nbytes for layer in w.layers for f in MATRICES)  # dense
    rest = w.output.nbytes + w.final_ln.nbytes + sum(
        t.nbytes for layer in w.layers for t in (layer.ln1, layer.ln2, layer.qkv_b)
        if t is not None)
    hd = w.dims.head_dim
    per_head = hd + 4 if kv_fp8 else 2 * hd
    kv_per_col = 2 * cfg.num_layers * w.dims.groups * per_head * B  # K and V, all rows
    kv = sum(kv_per_col * (P + s) for s in range(R - 1))
    return ((R - 1) * (matrices + rest) + kv) / (gbps * 1e9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", nargs="+", default=["qwen2_0_5b", "qwen2_1_5b"],
                    choices=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=["none", "fp8", "fp8_weight_only", "int4"],
                    choices=list(MODES),
                    help="fp8_weight_only: fp8 with rollout.kernel_options."
                         "fp8_weight_only_max_rows covering the decode batches; kv_fp8: "
                         "rollout.kv_cache_dtype=fp8 on bf16 weights")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--int4-kernel-max-rows", type=int,
                    default=DecodeKernelOptions().int4_kernel_max_rows,
                    help="rollout.kernel_options.int4_kernel_max_rows: int4 GEMMs of more rows "
                         "(the prefill; decode batches above it) dequantize the weight once and "
                         "run cuBLAS")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="H200: 4.8 TB/s")
    ap.add_argument("--out", default="benchmarks/results/quantized_rollout_h200.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    P, R = args.prompt_len, args.new_tokens
    report = {"generation": {}, "floors": {}, "quantized_gb": {},
              "setup": {"prompt_len": P, "new_tokens": R, "reps": args.reps, "dtype": str(dtype),
                        "hbm_gbps": args.hbm_gbps, "decode_kernels": "auto", "cuda_graphs": True,
                        "int4_kernel_max_rows": args.int4_kernel_max_rows},
              "machine": machine(), "versions": versions("triton"), "command": command()}
    for name in args.models:
        with open(os.path.join(CONF, MODELS[name])) as f:
            cfg = ModelConfig(**{k: v for k, v in yaml.safe_load(f).items() if k != "name"})
        params = random_params(cfg, device=device, dtype=dtype)
        for mode in args.modes:
            gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=device,
                            dtype=dtype, true_vocab_size=cfg.vocab_size,
                            quantization=MODES[mode][0])
            key = "bf16" if mode == "none" else mode  # the results file's name for it
            report["quantized_gb"].setdefault(key, {})[name] = gen.quantized_bytes / 1e9
            for B in args.batches:
                g = torch.Generator().manual_seed(B)
                prompts = torch.randint(0, cfg.vocab_size, (B, P), generator=g).tolist()
                rc = RolloutConfig(max_new_tokens=R, temperature=0.0, max_batch_size=B,
                                   return_logprobs=True, kv_cache_dtype=MODES[mode][1])
                window = max(64, math.ceil((P + R) / 8 / 64) * 64)  # config_auto's choice
                opts = DecodeOptions.from_config(rc).replace(
                    kv_window=window if device.type == "cuda" else 0,
                    fp8_weight_only_max_rows=B if mode == "fp8_weight_only" else 0,
                    int4_kernel_max_rows=args.int4_kernel_max_rows)

                def run():
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    out = gen.generate(prompts, cfg=rc, eos_id=-1, pad_id=0, seed=0, options=opts)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    assert out.response_ids.shape == (B, R)
                    return time.perf_counter() - t

                run()  # warm-up: cache, graph capture, Triton compiles
                secs = statistics.median(run() for _ in range(args.reps))
                report["generation"].setdefault(key, {}).setdefault(name, {})[str(B)] = secs
                report["floors"].setdefault(key, {}).setdefault(name, {})[str(B)] = floor_s(
                    gen, cfg, B=B, P=P, R=R, gbps=args.hbm_gbps,
                    kv_fp8=MODES[mode][1] == "fp8")
                print(f"{name} {mode:4s} B={B}: {secs:.3f} s (floor "
                      f"{report['floors'][key][name][str(B)]:.3f} s)", flush=True)
                # what is measured so far, in case the device call's limit ends the run
                write_json(args.out, {**report, "complete": False})
            gen.release()
            del gen
        del params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gen_ = report["generation"]
    if "bf16" in gen_:
        report["speedup_vs_bf16"] = {m: {n: {b: gen_["bf16"][n][b] / s for b, s in per.items()}
                                         for n, per in models.items()}
                                     for m, models in gen_.items() if m != "bf16"}
    write_json(args.out, {**report, "complete": True})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
