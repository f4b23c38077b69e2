"""Where a decode step's device time goes: kernel time per step by kind, for each model x batch x
eager/compiled decode (issue "Speed": generation at batch 256 >= 25% of the weight+KV read floor).

Random-init weights of the model shape (bench_generate's transformers model converted to Megatron
names), bf16, prompt --prompt-len tokens, greedy, CUDA graphs on. Each case: one call to allocate and
capture, then profiled calls of --steps and 2 x --steps new tokens: their difference over --steps
is one decode step's kernel time (the prefill and per-call work cancel), summed by kind (gemm,
attention, norm, elementwise, kv_write, sampling, other); the same difference of unprofiled wall
times (median of 3) is `wall_us_per_step`: kernel time plus the gaps between kernels. Also
printed: kernels per step and the weight+KV read floor of one step at the measured copy bandwidth.
`--prefill` adds a profile of a one-token call (the prefill); `--timeline` a trace of one call (host
ranges and kernels): the GPU's idle time by the generator's phase labels (generate.setup, .prefill,
.decode, .finish) and the longest idle gaps with what the host ran then (`--trace-dir`: Chrome
traces); `--compile-mode` tries another torch.compile mode for the compiled decode parts;
`--spec-rows N` runs every case with the speculative tail from N rows (rollout.speculative) and
adds its time per tail step beside the plain step's (with --batches of at most N the tail takes
over at the first stop poll; greedy on random weights keeps few drafts, but a tail step costs the
same whatever it keeps):

    python benchmarks/profile_decode.py --models hybridflow/conf/model/qwen2_5_coder_0_5b.yaml \
        --kernels triton --prompt-len 512 --steps 128 --timeline --batches 16 [--spec-rows 16] \
        --out ...

    python benchmarks/profile_decode.py --models hybridflow/conf/model/qwen2_0_5b.yaml hybridflow/conf/model/qwen2_1_5b.yaml \
        --batches 64 256 --compile [--kernels torch triton] --out benchmarks/results/decode_profile_h200.json
    python benchmarks/profile_decode.py --models hybridflow/conf/model/tiny.yaml --device cpu --batches 2 \
        --prompt-len 8 --steps 4 --out /tmp/p.json                      # CPU smoke (CPU op times)

`--multi-turn` profiles the multi-turn decode step instead (graphed and eager, per model x
--batches rows x --columns attended cache columns, with its parts timed alone):
profile_multi_turn.py says how.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_generate import (COPY_BW, add_decode_option_flags, decode_options,  # noqa: E402
                            hf_model, machine, to_megatron)
from gsm8k_hf_eval import write_json  # noqa: E402
from hybridflow.config import ModelConfig, RolloutConfig  # noqa: E402
from hybridflow.rollout import Generator  # noqa: E402
from hybridflow.profiling import FRAME, device_gaps, kernel_launches  # noqa: E402
from hybridflow.rollout.options import DecodeOptions  # noqa: E402

# first match wins; matched against the lower-cased kernel (or op) name
KINDS = (
    ("attention", ("sdpa", "fmha", "flash", "attention", "cudnn", "_attn_")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "addmm", "aten::mm", "matmul", "linear")),
    ("norm", ("layer_norm", "rms_norm", "norm_kernel")),
    ("kv_write", ("index_copy", "index_put", "scatter", "_rope_kv")),  # + RoPE in the kernel
    ("sampling", ("argmax", "softmax", "exponential", "topk", "sort", "reduce", "max_kernel",
                  "_mass_chunk", "_cdf_final")),  # kernels/sample.py's (fused_sampler)
    ("elementwise", ("elementwise", "vectorized", "triton", "copy", "fill", "cat", "roll", "mul",
                     "add", "silu")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def _call(gen, prompts, steps: int, opts: DecodeOptions, temperature: float = 0.0):
    """A generate call of `steps` new tokens under `opts` (greedy at temperature 0), as a function
    of no arguments."""
    cfg = RolloutConfig(max_new_tokens=steps, temperature=temperature,
                        max_batch_size=len(prompts))
    return lambda: gen.generate(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=opts)


def profile_calls(run, device, *, warm: bool = True) -> dict:
    """kernel (or, on CPU, aten op) name -> (time us, calls) of one profiled run() (after one
    unprofiled call when `warm`: allocation, capture, compilation)."""
    from torch.profiler import ProfilerActivity, profile

    if warm:
        run()
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    timeof = ((lambda e: getattr(e, "device_time_total", 0)) if device.type == "cuda" else
              (lambda e: e.self_cpu_time_total))
    events = [e for e in prof.key_averages() if timeof(e) > 0]
    if device.type != "cuda":  # CPU: aten ops only (their self time), not the Python frames
        events = [e for e in events if e.key.startswith("aten::")]
    return {e.key: (timeof(e), e.count) for e in events}


def _profiled(gen, prompts, *, steps: int, opts: DecodeOptions, device,
              temperature: float = 0.0) -> dict:
    """kernel (or aten op) name -> (time us, calls) of one generate call of `steps` new tokens."""
    return profile_calls(_call(gen, prompts, steps, opts, temperature), device)


def per_step(short: dict, long: dict, steps: int) -> dict:
    """key -> (time, calls) of a run of 2 x `steps` steps less one of `steps`, over `steps`: what
    one step launched (the per-call work cancels). Call counts are exact; a time difference, exact
    on the GPU's clock, can dip below 0 with CPU op timings: counted as 0 there."""
    per = {k: (max(0.0, (t - short.get(k, (0, 0))[0]) / steps),
               (n - short.get(k, (0, 0))[1]) / steps) for k, (t, n) in long.items()}
    return {k: v for k, v in per.items() if v[1] > 0}


def _by_kind(per: dict):
    """kernel -> (time, calls) summed by kind: (time by kind, calls by kind, the 15 longest)."""
    by_kind, count = collections.Counter(), collections.Counter()
    for k, (t, n) in per.items():
        by_kind[kind_of(k)] += t
        count[kind_of(k)] += n
    return by_kind, count, sorted(per.items(), key=lambda kv: kv[1][0], reverse=True)[:15]


def _wall_s(gen, prompts, *, steps: int, opts: DecodeOptions, device,
            temperature: float = 0.0) -> float:
    """Median wall seconds of 3 generate calls of `steps` new tokens (after one warm call)."""
    import statistics
    import time

    run = _call(gen, prompts, steps, opts, temperature)
    times = []
    for i in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_case(gen, prompts, *, steps: int, opts: DecodeOptions, device,
                 temperature: float = 0.0) -> dict:
    """Per decode step: the difference of a call of 2 x steps and one of steps new tokens, over
    steps (the prefill and the per-call work cancel)."""
    t = dict(opts=opts, device=device, temperature=temperature)
    short = _profiled(gen, prompts, steps=steps, **t)
    long = _profiled(gen, prompts, steps=2 * steps, **t)
    per = per_step(short, long, steps)  # the kernels the extra steps launched
    by_kind, count, top = _by_kind(per)
    # wall time of a step the same way (no profiler): kernel time + the gaps between kernels
    wall, tail = [], []
    for n in (steps, 2 * steps):
        wall.append(_wall_s(gen, prompts, steps=n, **t))
        tail.append(gen.stats["spec_steps"])
    # with the speculative tail (--spec-rows) the extra tokens took fewer steps: per tail step
    dt = tail[1] - tail[0]
    spec = {"tail_steps": tail, "wall_us_per_tail_step": (wall[1] - wall[0]) / dt * 1e6,
            "us_per_tail_step": sum(by_kind.values()) * steps / dt} if dt > 0 else {}
    return {**spec, "us_per_step": sum(by_kind.values()), "kernels_per_step": sum(count.values()),
            "wall_us_per_step": (wall[1] - wall[0]) / steps * 1e6,
            # a call less its decode steps: the prefill, first draw and per-call work
            "wall_call_rest_us": (2 * wall[0] - wall[1]) * 1e6,
            "us_per_step_by_kind": dict(by_kind.most_common()),
            "kernels_per_step_by_kind": {k: count[k] for k, _ in by_kind.most_common()},
            "top": [{"kernel": k[:100], "kind": kind_of(k), "us_per_step": t, "calls_per_step": n}
                    for k, (t, n) in top]}


def profile_prefill(gen, prompts, *, opts: DecodeOptions, device,
                    temperature: float = 0.0) -> dict:
    """A call of one new token: the prefill, the first draw and the per-call work (kernel time by
    kind, the top kernels, and its unprofiled wall time)."""
    t = dict(opts=opts, device=device, temperature=temperature)
    per = _profiled(gen, prompts, steps=1, **t)
    by_kind, count, top = _by_kind(per)
    wall = _wall_s(gen, prompts, steps=1, **t)
    return {"us": sum(by_kind.values()), "wall_us": wall * 1e6, "kernels": sum(count.values()),
            "us_by_kind": dict(by_kind.most_common()),
            "top": [{"kernel": k[:100], "kind": kind_of(k), "us": t, "calls": n}
                    for k, (t, n) in top]}


def launchers(gen, prompts, *, steps: int, device, opts: DecodeOptions, match: tuple,
              temperature: float = 0.0) -> dict:
    """Which host ops launch the kernels whose name holds one of `match` (e.g. "Memcpy"): a call of
    `steps` new tokens WITHOUT CUDA graphs (a replayed graph hides its launches), each such kernel
    counted under its launching op's chain of enclosing ops (innermost last) -> {chain: calls}."""
    run = _call(gen, prompts, steps, opts.replace(cuda_graphs=False), temperature)
    run()
    return traced(run, device)["launched"](match)


def python_frames(e, depth: int = 3) -> str:
    """The Python lines under which host event `e` ran, innermost first, without torch's own
    frames: from the profiler's Python-call events enclosing it (torch 2.x with `with_stack`), or
    else from the nearest enclosing op's recorded stack ("" where there is none: an op launched
    from C++, e.g. on the autograd engine's thread, or a trace without stacks)."""
    def mine(frames):
        return [f for f in frames if FRAME.match(f) and "torch/" not in FRAME.match(f)["file"]]

    found, p = [], e
    while p is not None and len(found) < depth:
        found += mine([p.name]) or mine(getattr(p, "stack", None) or [])[:depth - len(found)]
        p = p.cpu_parent
    return " < ".join(found[:depth])


def traced(run, device, *, trace: str | None = None, stacks: bool = False) -> dict:
    """One profiled call of `run` (host ops on every thread, device kernels): `kernels`
    [(start, end, launching chain)], `host` [(start, end, name)] in us on the profiler's clock, and
    `launched(match)` -> {"kernel <- chain": calls} for the kernels whose name holds one of `match`
    (`stacks`: each chain followed by " @ " and the Python lines that launched it, `python_frames`;
    profiling with stacks costs host time, so timings from such a trace are not the pass's);
    `trace`: also a Chrome trace file."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, with_stack=stacks) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    host = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == DeviceType.CPU]
    kernels = kernel_launches(prof, frames=python_frames if stacks else None)

    def launched(match: tuple) -> dict:
        found = collections.Counter(f"{n[:40]} <- {c}" for _, _, n, c, *_ in kernels
                                    if any(m.lower() in n.lower() for m in match))
        return dict(found.most_common(30))

    return {"kernels": [(a, b, c) for a, b, _, c, *_ in kernels], "host": host,
            "launched": launched}


def gpu_idle(kernels: list, ranges: list, *, min_gap_us: float = 20.0, top: int = 10,
             prefix: str = "generate.") -> dict:
    """Where the GPU sat idle during a traced call: `kernels` [(start, end)] of the device's work,
    `ranges` [(start, end, name)] of the host thread's ranges (the generator's "generate.*"
    phase labels, aten ops, CUDA runtime calls), all in us on the profiler's common clock. The
    window runs from the first phase label's start to the last kernel's (or label's) end; idle time
    is the window less the union of the kernels (`prefix`: the labels' start, e.g. "engine."
    for a training pass's). Each gap of at least `min_gap_us` is split among
    the phases by overlap (what the host was doing while the GPU ran dry; "none" outside every
    label); the `top` longest are listed with the phase and the innermost host range at their start."""
    labels = [r for r in ranges if r[2].startswith(prefix)]
    if not labels:
        return {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "idle_by_phase_us": {},
                "phase_us": {}, "gaps": []}
    start = min(r[0] for r in labels)
    end = max([r[1] for r in labels] + [k[1] for k in kernels])
    busy, gaps = device_gaps(kernels, start)
    t = max([start] + [k[1] for k in kernels])  # the end of the device's work
    if end > t:
        gaps.append((t, end))

    def covering(x, among):  # the innermost (shortest) range holding x, or None
        held = [r for r in among if r[0] <= x < r[1]]
        return min(held, key=lambda r: r[1] - r[0]) if held else None

    by_phase, listed = collections.Counter(), []
    for a, b in gaps:
        if b - a < min_gap_us:
            continue
        # a gap's time goes to the innermost label over each of its pieces (generate.spec_tail
        # runs inside generate.decode), "none" outside every label
        cuts = sorted({a, b, *(x for la, lb, _ in labels for x in (la, lb) if a < x < b)})
        for x, y in zip(cuts, cuts[1:]):
            label = covering((x + y) / 2, labels)
            by_phase[label[2] if label else "none"] += y - x
        listed.append((a, b, covering(a, labels)))
    listed.sort(key=lambda g: g[1] - g[0], reverse=True)
    phase_us = collections.Counter()
    for a, b, name in labels:
        phase_us[name] += b - a
    return {"window_us": end - start, "busy_us": busy,
            "idle_us": sum(b - a for a, b in gaps),
            "idle_by_phase_us": dict(by_phase.most_common()), "phase_us": dict(phase_us),
            "gaps": [{"at_us": a - start, "us": b - a, "phase": p[2] if p else "none",
                      "host": (covering(a, ranges) or (0, 0, "none"))[2]}
                     for a, b, p in listed[:top]]}


def profile_timeline(gen, prompts, *, steps: int, opts: DecodeOptions, device,
                     trace: str | None = None, temperature: float = 0.0) -> dict:
    """One traced generate call of `steps` new tokens (host ranges and device kernels): the GPU's
    idle time by the generator's phase (gpu_idle); `trace`: also a Chrome trace file."""
    run = _call(gen, prompts, steps, opts, temperature)
    run()
    t = traced(run, device, trace=trace)
    return {**gpu_idle([k[:2] for k in t["kernels"]], t["host"]),
            "tail_steps": gen.stats["spec_steps"], "tail_tokens": gen.stats["spec_tokens"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["hybridflow/conf/model/qwen2_0_5b.yaml"])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="new tokens of the profiled call")
    ap.add_argument("--compile", action="store_true", help="also profile rollout.compile_decode")
    ap.add_argument("--kernels", nargs="+", default=None, choices=["torch", "triton"],
                    help="rollout.decode_kernels values to profile (each with and without "
                         "--compile; default torch, with --multi-turn on a GPU torch and triton)")
    ap.add_argument("--no-eager", action="store_true", help="with --compile: the compiled cases only")
    add_decode_option_flags(ap)  # --pdl, --prefetch-weights, ..., --compile-mode
    ap.add_argument("--timeline", action="store_true",
                    help="also trace one call of --steps new tokens per model x batch: the GPU's "
                         "idle time by generator phase (setup, prefill, decode, finish)")
    ap.add_argument("--trace-dir", default=None, help="with --timeline: Chrome traces here")
    ap.add_argument("--prefill", action="store_true",
                    help="also profile a call of one new token (the prefill) per model x batch")
    ap.add_argument("--launchers", nargs="*", default=None, metavar="SUBSTRING",
                    help="also list the host ops that launch the kernels named with these "
                         "substrings (default Memcpy Memset), from a call without CUDA graphs")
    ap.add_argument("--multi-turn", action="store_true",
                    help="profile the multi-turn decode step instead (profile_multi_turn.py): "
                         "graphed and eager per model x --batches rows x --columns")
    ap.add_argument("--columns", type=int, nargs="+", default=[576, 1024],
                    help="--multi-turn: the cache columns a step attends over")
    ap.add_argument("--temperature", type=float, default=1.0, help="--multi-turn: rollout "
                    "temperature (0: greedy; the log-probs are computed either way)")
    ap.add_argument("--reps", type=int, default=20,
                    help="--multi-turn: timed calls per isolated piece (median)")
    ap.add_argument("--spec-rows", type=int, default=0,
                    help="the speculative tail (rollout.speculative.max_rows) for every case: "
                         "with --batches at most this, all but the first poll's steps are tail "
                         "steps (each case then also reports its time per tail step)")
    ap.add_argument("--spec-drafts", type=int, default=4, help="with --spec-rows: draft_tokens")
    ap.add_argument("--spec-fused-advance", action=argparse.BooleanOptionalAction, default=True,
                    help="with --spec-rows: rollout.speculative.fused_advance (the default; "
                         "--no-spec-fused-advance: the PyTorch ops)")
    ap.add_argument("--call-temperature", type=float, default=0.0,
                    help="the single-turn calls sample at this temperature (0: greedy; with "
                         "--spec-rows and --spec-fused-advance, > 0 runs the fused acceptance)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model's")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.kernels is None:
        args.kernels = (["torch", "triton"] if args.multi_turn and device.type == "cuda"
                        else ["torch"])
    if args.no_eager and not args.compile:
        ap.error("--no-eager profiles the compiled cases only: it needs --compile")
    modes = ([True] if args.no_eager else [False, True]) if args.compile else [False]
    base = decode_options(args, spec_rows=args.spec_rows, spec_draft_tokens=args.spec_drafts,
                          spec_fused_advance=args.spec_fused_advance)
    last = base.replace(kernels=args.kernels[-1], compile=args.compile)  # prefill, timeline, ...
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"machine": machine(device), "command": " ".join([sys.executable] + sys.argv),
              "prompt_len": args.prompt_len, "steps": args.steps,
              "decode_options": dataclasses.asdict(base), "cases": []}
    if args.multi_turn:
        from run_record import versions

        report.update(columns=args.columns, temperature=args.temperature, reps=args.reps,
                      versions=versions("hybridflow", "transformers", "triton"))
        for k in ("prompt_len", "decode_options"):  # the single-turn cases' settings
            report.pop(k)
    for path in args.models:
        with open(path) as f:
            spec = yaml.safe_load(f)
        if args.layers:
            spec["num_layers"] = args.layers
        cfg = ModelConfig(**spec)
        torch.manual_seed(0)
        hf = hf_model(cfg, device=device, dtype=dtype)
        params = {n: t.clone() for n, t in to_megatron(hf.state_dict(), cfg).items()}
        del hf
        weight_bytes = sum(t.numel() * t.element_size() for t in params.values())
        hd = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=device, dtype=dtype,
                        true_vocab_size=cfg.vocab_size)
        if args.multi_turn:
            import profile_multi_turn

            profile_multi_turn.run(args, report, cfg=cfg, gen=gen, weight_bytes=weight_bytes,
                                   device=device)
            gen.release()
            del gen
            continue
        for B in args.batches:
            prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len)).tolist()
            # K and V of every layer at the mean context of the steps measured
            ctx = args.prompt_len + 1.5 * args.steps  # the mean context of the later steps
            kv_bytes = 2 * cfg.num_layers * B * cfg.num_query_groups * hd * ctx * 2
            floor_us = (weight_bytes + kv_bytes) / COPY_BW * 1e6
            for kernels, compiled in [(k, c) for k in args.kernels for c in modes]:
                res = profile_case(gen, prompts, steps=args.steps, device=device,
                                   opts=base.replace(kernels=kernels, compile=compiled),
                                   temperature=args.call_temperature)
                res.update(model=cfg.name, batch=B, compiled=compiled, kernels=kernels,
                           compile_mode=args.compile_mode if compiled else None,
                           floor_us_per_step=floor_us,
                           floor_fraction=floor_us / res["us_per_step"])
                report["cases"].append(res)
                print(f"{cfg.name} B={B} kernels={kernels} compiled={compiled}: "
                      f"{res['us_per_step']:.0f} us/step ({res['wall_us_per_step']:.0f} wall, "
                      f"{res['wall_call_rest_us']:.0f} us rest of a call), "
                      f"{res['kernels_per_step']:.0f} kernels, floor {floor_us:.0f} us "
                      f"({100 * res['floor_fraction']:.0f}%)  " +
                      ", ".join(f"{k} {v:.0f}" for k, v in res["us_per_step_by_kind"].items()),
                      flush=True)
                if "us_per_tail_step" in res:
                    print(f"  tail steps {res['tail_steps']}: {res['us_per_tail_step']:.0f} us "
                          f"kernels, {res['wall_us_per_tail_step']:.0f} us wall per tail step",
                          flush=True)
                write_json(args.out, report)  # after every case: a call cut off keeps what it measured
            if args.prefill:
                res = profile_prefill(gen, prompts, opts=last, device=device,
                                      temperature=args.call_temperature)
                res.update(model=cfg.name, batch=B, prompt_tokens=B * args.prompt_len)
                report.setdefault("prefill", []).append(res)
                print(f"{cfg.name} B={B} prefill call: {res['us']:.0f} us kernels "
                      f"({res['wall_us']:.0f} wall), {res['kernels']:.0f} kernels  " +
                      ", ".join(f"{k} {v:.0f}" for k, v in res["us_by_kind"].items()), flush=True)
                for t in res["top"][:10]:
                    print(f"    {t['us']:8.0f} us {t['calls']:4.0f}x {t['kernel']}", flush=True)
            if args.launchers is not None:
                res = launchers(gen, prompts, steps=args.steps, device=device, opts=last,
                                match=tuple(args.launchers) or ("Memcpy", "Memset"),
                                temperature=args.call_temperature)
                report.setdefault("launchers", []).append({"model": cfg.name, "batch": B,
                                                           "steps": args.steps, "calls": res})
                write_json(args.out, report)
                print(f"{cfg.name} B={B} launchers of a {args.steps}-token call without graphs:",
                      flush=True)
                for chain, n in res.items():
                    print(f"    {n:5d}x {chain}", flush=True)
            if args.timeline:
                trace = (os.path.join(args.trace_dir, f"{cfg.name}_b{B}.json") if args.trace_dir
                         else None)
                if trace:
                    os.makedirs(args.trace_dir, exist_ok=True)
                res = profile_timeline(gen, prompts, steps=args.steps, opts=last, device=device,
                                       trace=trace, temperature=args.call_temperature)
                res.update(model=cfg.name, batch=B, steps=args.steps)
                report.setdefault("timeline", []).append(res)
                write_json(args.out, report)
                if res["tail_steps"]:
                    n = res["tail_steps"]
                    wall = res["phase_us"].get("generate.spec_tail", 0) / n
                    idle = res["idle_by_phase_us"].get("generate.spec_tail", 0) / n
                    print(f"  {n} tail steps ({res['tail_tokens']} tokens): {wall:.0f} us each, "
                          f"GPU idle {idle:.0f} us of it", flush=True)
                print(f"{cfg.name} B={B} timeline of a {args.steps}-token call: {res['window_us']:.0f} us, "
                      f"GPU idle {res['idle_us']:.0f} us: " +
                      ", ".join(f"{k} {v:.0f}" for k, v in res["idle_by_phase_us"].items()), flush=True)
                for g in res["gaps"]:
                    print(f"    {g['us']:8.0f} us idle at {g['at_us']:9.0f} us ({g['phase']}; host: "
                          f"{g['host'][:80]})", flush=True)
            gen.release()
        del gen
    write_json(args.out, report)


if __name__ == "__main__":
    main()
