"""Generation speed: hybridflow's in-place Generator vs transformers `generate` vs the weight-read floor.

Qwen2-0.5B shape (hybridflow/conf/model/qwen2_0_5b.yaml), random init, bf16, prompt 128 tokens, 256 new tokens
forced (greedy with eos_id=-1, which is never sampled), batch 64 and 256. transformers runs its
`Qwen2ForCausalLM` with SDPA attention and the default dynamic cache; ours runs the same weights
converted to Megatron names (QKV packed per query group [q_g; k_g; v_g], fc1 = [gate; up], tied
embedding). Floor = weight bytes / 4.3e12 B/s (measured H200 copy bandwidth) x new tokens; a second
floor adds the KV-cache reads. Also checked: greedy tokens of ours vs transformers (fp32 small batch:
exact; bf16: agreement on the first steps), CUDA graphs vs eager, seeded sampling reproducibility,
peak memory during generation and memory after `release()`.

    python benchmarks/bench_generate.py                       # H200: writes results JSON
    python benchmarks/bench_generate.py --model hybridflow/conf/model/tiny.yaml --device cpu --batches 4 \\
        --prompt-len 8 --new-tokens 8 --out /tmp/g.json        # CPU smoke run

Both sides are timed alike: a warm-up call first (ours: reported as ours_first_call_s; transformers:
one full-length generate), then the median of >= 3 calls (--reps, --hf-reps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridflow.config import ModelConfig, RolloutConfig  # noqa: E402
from hybridflow.rollout import Generator  # noqa: E402
from hybridflow.rollout.options import PREFETCHABLE, DecodeOptions  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gsm8k_hf_eval import write_json  # noqa: E402  (temp file + os.replace)

COPY_BW = 4.3e12  # B/s, device-to-device copy measured on the H200 (shared/DESIGN.md)


def hf_model(cfg: ModelConfig, *, device, dtype):
    """transformers' model class of `cfg`'s architecture (Qwen2 / Llama / Qwen3 / Qwen3-MoE: the
    config.json our export writes), random init, SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.models.hf_config import write_hf_config

    d = write_hf_config(cfg)
    for k in ("architectures", "dtype", "torch_dtype", "rope_theta", "rope_scaling"):
        d.pop(k, None)
    hc = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hc, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def unfuse_experts(sd: dict) -> dict:
    """transformers 5 holds a Qwen3-MoE layer's experts as two stacked tensors
    (`mlp.experts.gate_up_proj` (E, 2F, H) = [gate; up], `mlp.experts.down_proj` (E, H, F)); its
    checkpoints, and our loader, name each expert's projections."""
    out = {}
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, F = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = t[e, :F], t[e, F:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def to_megatron(sd: dict, cfg: ModelConfig) -> dict:
    """HF Qwen2/Llama/Qwen3/Qwen3-MoE state dict -> Megatron names (full tensors, TP=1)."""
    sd = unfuse_experts(sd)
    try:
        from hybridflow.models.hf import hf_to_megatron_state_dict  # needs megatron-core

        return hf_to_megatron_state_dict(sd, cfg)
    except ImportError:
        pass
    G, H = cfg.num_query_groups, cfg.num_attention_heads
    hd = cfg.kv_channels or cfg.hidden_size // H
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            q, k, v = (sd[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
            rest = q.shape[1:]
            out[m + f"self_attention.linear_qkv.{kind}"] = torch.cat(
                [q.reshape(G, H // G * hd, *rest), k.reshape(G, hd, *rest),
                 v.reshape(G, hd, *rest)], 1).reshape(-1, *rest)
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                      sd[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[m + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int, times: list | None = None):
    """Median seconds of `reps` calls (each time appended to `times` when given) and the last output."""
    times, out = ([] if times is None else times), None
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def hf_generate(model, ids, new_tokens):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]


def agreement(a: torch.Tensor, b: torch.Tensor, first: int) -> dict:
    same = (a == b).long().cumprod(1).sum(1).float()  # length of the common prefix per row
    return {"rows_agree_first_steps": float((same >= first).float().mean()), "first_steps": first,
            "mean_common_prefix": float(same.mean())}


def profile_decode(run, B: int, steps: int = 32) -> dict:
    """Kernel time per decode step (graph replays included) and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    short = RolloutConfig(max_new_tokens=steps + 1, temperature=0.0, max_batch_size=B)
    run(short)  # capture
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(short)
    events = prof.key_averages()
    dev = lambda e: getattr(e, "device_time_total", 0)  # noqa: E731
    events = sorted(events, key=dev, reverse=True)
    total = sum(dev(e) for e in events)
    top = [{"kernel": e.key[:90], "us_per_step": dev(e) / steps, "calls_per_step": e.count / steps}
           for e in events[:12]]
    for t in top:
        print(f"{t['us_per_step']:9.1f} us/step {t['calls_per_step']:6.1f} x  {t['kernel']}")
    return {"device_us_per_step_incl_prefill": total / steps,
            "kernels_per_step": sum(e.count for e in events) / steps, "top": top}


def mem_gb(device):
    return torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0


def machine(device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpus": os.cpu_count(), "host": platform.node()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return info


def add_decode_option_flags(ap: argparse.ArgumentParser) -> None:
    """The decode kernels' options a run A/Bs (rollout.kernel_options, fields of
    hybridflow/rollout/options.DecodeOptions; a flag left out keeps the default)."""
    ap.add_argument("--pdl", choices=["on", "off"], default=None,
                    help="our Triton kernels launched with programmatic dependent launch (sm_90+: "
                         "each waits for its predecessor's writes in-kernel; "
                         "rollout.kernel_options.pdl)")
    ap.add_argument("--prefetch-weights", nargs="*", default=None, choices=list(PREFETCHABLE),
                    help="the decode GEMMs whose weights the kernel before them hints into L2 "
                         "(rollout.kernel_options.prefetch_weights)")
    ap.add_argument("--prefetch-min-rows", type=int, default=None,
                    help="the fewest decode rows (graph bucket) that issue the L2 hints "
                         "(rollout.kernel_options.prefetch_min_rows)")
    ap.add_argument("--swiglu-gemm-min-rows", type=int, default=None,
                    help="the fewest decode rows (graph bucket) that run fc1 + SwiGLU as one "
                         "Triton GEMM (rollout.kernel_options.swiglu_gemm_min_rows)")
    ap.add_argument("--fused-sampler", choices=["on", "off"], default=None,
                    help="with --decode-kernels triton and a temperature draw: the draw and its "
                         "log-prob as kernels/sample.py's two passes over the logits "
                         "(rollout.kernel_options.fused_sampler)")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode of rollout.compile_decode (e.g. "
                         "max-autotune-no-cudagraphs; rollout.kernel_options.compile_mode)")


def decode_options(args, **fields) -> DecodeOptions:
    """DecodeOptions(**fields) with the flags of add_decode_option_flags that were given."""
    given = {"pdl": None if args.pdl is None else args.pdl == "on",
             "prefetch_weights": args.prefetch_weights,
             "prefetch_min_rows": args.prefetch_min_rows,
             "swiglu_gemm_min_rows": args.swiglu_gemm_min_rows,
             "fused_sampler": None if args.fused_sampler is None else args.fused_sampler == "on",
             "compile_mode": args.compile_mode}
    return DecodeOptions(**fields, **{k: v for k, v in given.items() if v is not None})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="hybridflow/conf/model/qwen2_0_5b.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-reps", type=int, default=3,
                    help="timed transformers calls after one full-length warm-up (median; >= 3)")
    ap.add_argument("--compile-decode", action="store_true",
                    help="also time rollout.compile_decode=true (first call: compile + capture)")
    ap.add_argument("--skip-checks", action="store_true",
                    help="leave out the eager, sampling and profile extras of the first batch")
    ap.add_argument("--kv-window", type=int, default=None,
                    help="rollout.decode_kv_window for the timed runs (a multiple of 64): each "
                         "decode step reads the cache's written columns rounded up to it instead "
                         "of prompt + new tokens (the floor counts only written columns)")
    ap.add_argument("--decode-kernels", default="torch", choices=["torch", "triton"],
                    help="rollout.decode_kernels for our timed runs")
    ap.add_argument("--no-hf", action="store_true",
                    help="time ours only at the timed batches (the floor fractions; an A/B of our "
                         "options in one call), no transformers generate")
    add_decode_option_flags(ap)
    ap.add_argument("--out", default="benchmarks/results/generate_h200.json")
    args = ap.parse_args()
    opts = decode_options(args, kernels=args.decode_kernels, kv_window=args.kv_window or 0)
    if args.hf_reps < 3 or args.reps < 3:
        raise ValueError(f"--reps={args.reps} / --hf-reps={args.hf_reps}: medians need >= 3 timed "
                         "calls each (issue 12: honest baselines)")
    device = torch.device(args.device)
    with open(args.model) as f:
        cfg = ModelConfig(**yaml.safe_load(f))
    torch.manual_seed(0)
    P, R = args.prompt_len, args.new_tokens
    report = {"machine": machine(device), "command": " ".join([sys.executable] + sys.argv),
              "model": cfg.name, "prompt_len": P, "new_tokens": R, "kv_window": args.kv_window,
              "decode_kernels": args.decode_kernels, "decode_options": dataclasses.asdict(opts),
              "no_hf": args.no_hf,
              "results": {},
              "timing": {"ours": f"first call (cache allocation, graph capture) reported apart as "
                                 f"ours_first_call_s; ours_s = median of the next {args.reps}",
                         "transformers": f"one warm-up generate at the timed shape ({R} new "
                                         f"tokens); hf_s = median of the next {args.hf_reps} "
                                         "(hf_all_s lists them)"}}

    # ---- sanity in fp32 (small batch): our greedy tokens == transformers' ----
    hf = hf_model(cfg, device=device, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (4, min(P, 32)), device=device)
    gen = Generator(model_cfg=cfg, params=to_megatron(hf.state_dict(), cfg), tp_group=None,
                    device=device, dtype=torch.float32, true_vocab_size=cfg.vocab_size)
    greedy = RolloutConfig(max_new_tokens=16, temperature=0.0, max_batch_size=max(args.batches))
    ours = gen.generate(ids.tolist(), cfg=greedy, eos_id=-1, pad_id=0, seed=0).response_ids
    with torch.no_grad():
        theirs = hf_generate(hf, ids, 16)
    report["sanity_fp32_16_steps"] = agreement(ours, theirs, 16)
    gen.release()
    del gen

    # ---- bf16 timings ----
    hf = hf.to(torch.bfloat16)
    params = to_megatron(hf.state_dict(), cfg)  # tied embedding: one tensor, no output_layer
    params = {n: t.clone() for n, t in params.items()}  # our own copy, like the reshard's buffers
    weight_bytes = sum(t.numel() * t.element_size() for t in params.values())
    base0 = mem_gb(device)
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=device,
                    dtype=torch.bfloat16, true_vocab_size=cfg.vocab_size)
    hd = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    for B in args.batches:
        ids = torch.randint(0, cfg.vocab_size, (B, P), device=device)
        prompts = ids.tolist()
        rcfg = RolloutConfig(max_new_tokens=R, temperature=0.0, max_batch_size=max(args.batches))
        run = lambda c=rcfg, o=opts: gen.generate(prompts, cfg=c, eos_id=-1, pad_id=0,  # noqa
                                                  seed=0, options=o)
        res = {}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = mem_gb(device)
        first_s, _ = timed(run, device, 1)  # includes cache allocation and graph capture
        ours_s, out = timed(run, device, args.reps)
        assert out.response_ids.shape == (B, R), out.response_ids.shape
        res["memory_gb"] = {
            "weights": weight_bytes / 2**30, "allocated_before_generate": before,
            "peak_during_generate": (torch.cuda.max_memory_allocated() / 2**30
                                     if device.type == "cuda" else 0.0),
            "allocated_after_generate": mem_gb(device),
            "kv_cache": gen._cache.nbytes / 2**30}
        gen.release()
        res["memory_gb"]["allocated_after_release"] = mem_gb(device)
        kv_bytes = sum(2 * cfg.num_layers * B * cfg.num_query_groups * hd * 2 * (P + s)
                       for s in range(R))
        res.update(ours_s=ours_s, ours_first_call_s=first_s, ours_tok_s=B * R / ours_s,
                   floor_s=weight_bytes / COPY_BW * R,
                   floor_with_kv_s=(weight_bytes * R + kv_bytes) / COPY_BW)
        if args.compile_decode:  # after the eager-step timings: the same prompts and greedy config
            copts = opts.replace(compile=True)
            res["ours_compiled_first_call_s"], _ = timed(lambda: run(o=copts), device, 1)
            res["ours_compiled_s"], out_c = timed(lambda: run(o=copts), device, args.reps)
            res["ours_compiled_tok_s"] = B * R / res["ours_compiled_s"]
            # bf16: fusion reorders roundings, so greedy paths may part after a near-tie
            res["compiled_vs_eager_step_greedy"] = agreement(out_c.response_ids, out.response_ids,
                                                             16)
            gen.release()
        if B == args.batches[0] and not args.skip_checks:
            eager = RolloutConfig(max_new_tokens=R, temperature=0.0, max_batch_size=B)
            eager_opts = opts.replace(cuda_graphs=False)
            res["ours_eager_s"], out_e = timed(lambda: run(eager, eager_opts), device, 1)
            res["graph_equals_eager_greedy"] = bool(torch.equal(out_e.response_ids,
                                                                out.response_ids))
            for name, kw in (("t1", {}), ("t1_top_p0.9", {"top_p": 0.9}),
                             ("t1_top_k50", {"top_k": 50})):
                samp = RolloutConfig(max_new_tokens=R, temperature=1.0, max_batch_size=B, **kw)
                run(samp)  # capture
                res[f"ours_sample_{name}_s"], s1 = timed(lambda: run(samp), device, 1)
                s2 = run(samp)
                res[f"sample_{name}_reproducible"] = bool(torch.equal(s1.response_ids,
                                                                      s2.response_ids))
            if device.type == "cuda":
                res["decode_profile"] = profile_decode(run, B)
            gen.release()
        res.update(ours_over_floor=ours_s / res["floor_s"],
                   floor_with_kv_fraction=res["floor_with_kv_s"] / ours_s)
        if "ours_compiled_s" in res:
            res["floor_with_kv_fraction_compiled"] = res["floor_with_kv_s"] / res["ours_compiled_s"]
        if not args.no_hf:
            with torch.no_grad():
                hf_generate(hf, ids, R)  # warm-up: same shape and length as the timed calls
                hf_all = []
                hf_s, theirs = timed(lambda: hf_generate(hf, ids, R), device, args.hf_reps, hf_all)
            res.update(hf_s=hf_s, hf_all_s=hf_all, hf_warmup_calls=1, hf_tok_s=B * R / hf_s,
                       speedup_vs_hf=hf_s / ours_s)
            if "ours_compiled_s" in res:
                res["speedup_vs_hf_compiled"] = hf_s / res["ours_compiled_s"]
            res["bf16_greedy_vs_hf"] = agreement(out.response_ids, theirs, 4)
        report["results"][str(B)] = res
        print(json.dumps({B: res}, indent=1), flush=True)
    del gen
    report["memory_gb_after_all_released"] = mem_gb(device)
    report["memory_gb_before_generator"] = base0
    write_json(args.out, report)  # temp file + os.replace
    print(f"\n{'batch':>6} {'ours s':>8} {'tok/s':>9} {'HF s':>7} {'HF tok/s':>9} {'x HF':>6} "
          f"{'floor s':>8} {'floor+kv':>8} {'peak GB':>8} {'after rel':>9}")
    for B, r in report["results"].items():
        m = r["memory_gb"]
        hf = {k: r.get(k, float("nan")) for k in ("hf_s", "hf_tok_s", "speedup_vs_hf")}  # --no-hf
        print(f"{B:>6} {r['ours_s']:8.3f} {r['ours_tok_s']:9.0f} {hf['hf_s']:7.2f} "
              f"{hf['hf_tok_s']:9.0f} {hf['speedup_vs_hf']:6.1f} {r['floor_s']:8.3f} "
              f"{r['floor_with_kv_s']:8.3f} {m['peak_during_generate']:8.2f} "
              f"{m['allocated_after_release']:9.2f}")
    print("sanity fp32:", report["sanity_fp32_16_steps"])


if __name__ == "__main__":
    main()
