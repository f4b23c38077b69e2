"""What a prompt width not seen before costs a generate call, with and without
`rollout.kernel_options.prefill_width_multiple`.

The GSM8K step's prefill runs its 64 prompts as one sub-batch over the widest of them, so every
step whose longest prompt has a new length meets the prefill's attention (cuDNN's SDPA, which
builds an execution plan per shape) and GEMMs at a shape they have not run. Here one generator
(random weights of the model's shape, kept across calls as the trainer keeps it) runs generate
calls of 64 random prompts x 8 samples whose longest prompt takes each of WIDTHS in turn, twice:
the first pass meets each width new, the second has seen them all. Each multiple runs in its own
process (the plan caches are per process) with compile caches of its own (Triton's and
inductor's, in a fresh folder: what a fresh machine or container has; `--shared-caches` keeps the
user's), after one call at the widest prompt that allocates the KV cache and captures the decode
graphs. The per-call difference of the passes' medians is what a new width costs, and each first-
pass call is listed with its width's alignment (the largest of 1, 2, 4, 8, 16 dividing it): code
compiled per alignment class costs the first width of a class far more than a new shape of a class
already seen (docs/perf_log.md). Rounded widths (64) leave the first pass one new shape.

    python benchmarks/bench_prefill_widths.py --out benchmarks/results/prefill_widths_h100.json
    python benchmarks/bench_prefill_widths.py --model tiny --device cpu --prompts 4 --n 2 \\
        --widths 9 11 13 --new-tokens 2 --out /tmp/pw.json            # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the widest prompts of the 60-step H200 run's first 21 steps, in the order they came, and step
# 30's (its first multiple of 16)
GSM8K_WIDTHS = [178, 155, 179, 170, 167, 185, 165, 169, 164, 157, 162, 161, 177, 172, 160]


def alignment(width: int) -> int:
    """The largest of 1, 2, 4, 8, 16 that divides `width`."""
    return next(m for m in (16, 8, 4, 2, 1) if width % m == 0)


def one_process(a) -> dict:
    import random

    import torch

    from bench_generate import machine
    from bench_multi_turn import random_params
    from hybridflow.config import RolloutConfig
    from hybridflow.cost.shapes import load_shape
    from hybridflow.rollout import Generator
    from hybridflow.rollout.options import DecodeOptions

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = load_shape(a.model)
    gen = Generator(model_cfg=cfg, params=random_params(cfg, device=device, dtype=dtype),
                    tp_group=None, device=device, dtype=dtype, true_vocab_size=cfg.vocab_size)
    rcfg = RolloutConfig(n=a.n, max_new_tokens=a.new_tokens, temperature=1.0,
                         max_batch_size=a.prompts * a.n, decode_kv_window=a.kv_window,
                         compact_finished_rows=True, return_logprobs=True)
    opts = DecodeOptions.from_config(rcfg).replace(prefill_width_multiple=a.only)
    rng = random.Random(0)

    def prompts(width: int) -> list:  # one prompt at `width`, the rest shorter (GSM8K's spread)
        lens = [width] + [rng.randint(min(a.shortest, width), width) for _ in range(a.prompts - 1)]
        return [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lens]

    def call(width: int) -> float:
        batch = prompts(width)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen.generate(batch, cfg=rcfg, eos_id=-1, pad_id=0, seed=0, options=opts)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first_s = call(a.warm_width or max(a.widths))  # cache allocation, graph capture
    passes = [[call(w) for w in a.widths] for _ in range(a.passes)]
    new, seen = statistics.median(passes[0]), statistics.median(
        [t for p in passes[1:] for t in p])
    first_pass = [{"width": w, "alignment": alignment(w), "s": t, "class_new": alignment(w) not in
                   {alignment(x) for x in [a.warm_width or max(a.widths), *a.widths[:i]]}}
                  for i, (w, t) in enumerate(zip(a.widths, passes[0]))]
    return {"prefill_width_multiple": a.only, "first_call_s": first_s, "calls_s": passes,
            "first_pass": first_pass, "new_width_median_s": new, "seen_width_median_s": seen,
            "new_width_cost_s": new - seen, "machine": machine(device),
            "prefills": gen.stats["prefills"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_coder_0_5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--kv-window", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="+", default=GSM8K_WIDTHS)
    ap.add_argument("--warm-width", type=int, default=232, help="the first call's widest prompt "
                    "(the GSM8K recipe's longest: the cache never grows after it)")
    ap.add_argument("--shortest", type=int, default=67)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--multiples", type=int, nargs="+", default=[1, 64, 64, 1],
                    help="one process each, in this order")
    ap.add_argument("--shared-caches", action="store_true",
                    help="keep the user's Triton and inductor caches (default: a fresh folder "
                    "per process)")
    ap.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", required=True)
    given = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(given)
    if a.only is not None:
        print(json.dumps(one_process(a)), flush=True)
        return
    runs = []
    for m in a.multiples:
        with tempfile.TemporaryDirectory(prefix="prefill_widths_") as tmp:
            env = dict(os.environ) if a.shared_caches else dict(
                os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *given, "--only",
                                   str(m)], check=True, capture_output=True, text=True, cwd=ROOT,
                                  env=env)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(r)
        firsts = [c for c in r["first_pass"] if c["class_new"]]
        print(f"multiple {m:3d}: new widths {r['new_width_median_s'] * 1e3:7.1f} ms, seen "
              f"{r['seen_width_median_s'] * 1e3:7.1f} ms, a new width costs "
              f"{r['new_width_cost_s'] * 1e3:6.1f} ms (first call {r['first_call_s']:.2f} s); "
              f"first of an alignment class: " + ", ".join(
                  f"{c['width']} ({c['alignment']}) {c['s'] * 1e3:.0f} ms" for c in firsts),
              flush=True)
    from gsm8k_hf_eval import write_json

    write_json(a.out, {
        "benchmark": "generate calls at prompt widths new and seen, by prefill_width_multiple",
        "command": "python benchmarks/bench_prefill_widths.py " + " ".join(given),
        "machine": runs[0]["machine"] if runs else None,
        "workload": {"model": a.model, "prompts": a.prompts, "n": a.n,
                     "new_tokens": a.new_tokens, "widths": a.widths, "passes": a.passes},
        "compile_caches": "shared (the user's)" if a.shared_caches else "fresh per process",
        "runs": runs})


if __name__ == "__main__":
    main()
