"""Generation with a long tail of response lengths: row compaction on vs off.

RL rollouts stop at very different steps (GSM8K, Qwen2.5-0.5B: mean ~300 tokens, ~0.5-1% of rows
at the 1,024 cap), and a static decode batch runs every row until the longest stops. This times
`Generator.generate` with `rollout.compact_finished_rows` on and off (rollout/compaction.py), and
with `--kv-window W` also `rollout.decode_kv_window=W` alone and with compaction (decode attends
over the written part of the cache only); with `--own-columns-ab` (and --kv-window) instead
compaction + window with `rollout.kernel_options.own_columns_only` on ("on") and off ("off").

Lengths: random-init weights (Qwen2-0.5B shape, bf16, as bench_generate.py) give a near-uniform
next-token distribution, so sampling at T = 1 with k = V / --tail-mean random stop ids stops a row
with probability ~1/--tail-mean per step: geometric lengths of mean ~--tail-mean cut at
--new-tokens (mean 300, cap 1,024: ~3% at the cap, so a batch of 512 always runs to the end). The
measured lengths are recorded per side: the sampled streams differ with compaction on (the batch
size changes the Philox offsets), so the sides draw different, equally distributed, lengths.

    python benchmarks/bench_long_tail.py --out benchmarks/results/generate_long_tail_h200.json
    python benchmarks/bench_long_tail.py --model hybridflow/conf/model/tiny.yaml --device cpu --batches 16 \\
        --prompt-len 8 --new-tokens 64 --tail-mean 16 --out /tmp/lt.json    # CPU smoke run

Per batch size and side: `first_s`, a call on a released Generator (cache allocation and graph
capture: what every RL step pays, since the trainer builds a Generator per step; compaction
captures the ladder buckets too), then --reps calls alternating on/off (drift hits both sides),
median `s`. JSON: results[B][on|off] = {first_s, s, s_all, stats (decode row-steps run, the same
steps uncompacted, compactions), lengths}; speedup_first / speedup = off / on.
The real-workload check is the GSM8K run's `timing_s/gen` with rollout.compact_finished_rows=true
against =false. With --spec-ab the "on" side's stats count the speculative tail's steps
(spec_steps, spec_tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_generate import hf_model, machine, timed, to_megatron  # noqa: E402
from benchmarks.run_record import command, versions, write_json  # noqa: E402
from hybridflow.config import (DecodeKernelOptions, ModelConfig, RolloutConfig,  # noqa: E402
                               SpeculativeConfig)
from hybridflow.rollout import Generator  # noqa: E402


def lengths(out, cap: int) -> dict:
    n = out.response_mask.sum(1).float()
    q = torch.quantile(n, torch.tensor([0.5, 0.9, 0.99], device=n.device)).tolist()
    return {"mean": float(n.mean()), "p50": q[0], "p90": q[1], "p99": q[2], "max": int(n.max()),
            "frac_at_cap": float((n == cap).float().mean())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="hybridflow/conf/model/qwen2_0_5b.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[512, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--tail-mean", type=float, default=300.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-window", type=int, default=0,
                    help="also time rollout.decode_kv_window=W, alone ('window') and with "
                         "compaction ('on_window')")
    ap.add_argument("--own-columns-ab", action="store_true",
                    help="instead: compaction + --kv-window with the attention over each row's own "
                         "columns ('on', rollout.kernel_options.own_columns_only) against every "
                         "column of the window ('off')")
    ap.add_argument("--spec-ab", type=int, default=0, metavar="ROWS",
                    help="instead: compaction (+ --kv-window) with the tail from ROWS running rows "
                         "by speculative sampling ('on', rollout.speculative, 4 drafts) against "
                         "without ('off'). Random weights keep almost no draft: the time "
                         "difference over the tail's steps is what a tail step costs more than a "
                         "plain one (the GSM8K step's variant 'spec' measures the gain)")
    ap.add_argument("--decode-kernels", default="auto", choices=("auto", "torch", "triton"),
                    help="rollout.decode_kernels of every side (torch: the PyTorch decode step and "
                         "speculative tail)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="rollout.kernel_options.pdl=false on every side (kernels launched without "
                         "programmatic dependent launch)")
    ap.add_argument("--prompt-spread", type=int, default=0,
                    help="prompt lengths uniform in [prompt-len - spread, prompt-len] (left "
                         "padding to the longest, as a GSM8K batch)")
    ap.add_argument("--out", default="benchmarks/results/generate_long_tail_h200.json")
    args = ap.parse_args()
    if args.reps < 3:
        raise ValueError(f"--reps={args.reps}: medians need >= 3 timed calls")
    device = torch.device(args.device)
    with open(args.model) as f:
        cfg = ModelConfig(**yaml.safe_load(f))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    params = {n: t.clone() for n, t in
              to_megatron(hf_model(cfg, device=device, dtype=dtype).state_dict(), cfg).items()}
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=device, dtype=dtype,
                    true_vocab_size=cfg.vocab_size)
    V, R = cfg.vocab_size, args.new_tokens
    k = max(1, round(V / args.tail_mean))
    stop = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:k].tolist()
    report = {"machine": machine(device), "versions": versions("transformers"), "command": command(),
              "model": cfg.name, "prompt_len": args.prompt_len, "new_tokens": R,
              "tail_mean": args.tail_mean, "num_stop_ids": k, "pdl": not args.no_pdl,
              "prompt_spread": args.prompt_spread, "results": {}}
    for B in args.batches:
        spread = torch.randint(0, args.prompt_spread + 1, (B,)).tolist()
        prompts = [torch.randint(0, V, (args.prompt_len - s,)).tolist() for s in spread]
        sides = {"on": dict(compact_finished_rows=True), "off": {}}
        if args.own_columns_ab:  # "on" / "off": the own-column attention on / off
            if not args.kv_window:
                raise ValueError("--own-columns-ab needs --kv-window (the recipe's window)")
            both = dict(compact_finished_rows=True, decode_kv_window=args.kv_window)
            sides = {side: dict(both, kernel_options=DecodeKernelOptions(own_columns_only=own))
                     for side, own in (("on", True), ("off", False))}
        elif args.spec_ab:
            both = dict(compact_finished_rows=True, decode_kv_window=args.kv_window)
            sides = {"on": dict(both, speculative=SpeculativeConfig(enable=True,
                                                                    max_rows=args.spec_ab)),
                     "off": both}
        elif args.kv_window:
            sides.update(window=dict(decode_kv_window=args.kv_window),
                         on_window=dict(compact_finished_rows=True, decode_kv_window=args.kv_window))
        if args.no_pdl:
            for kw in sides.values():
                kw["kernel_options"] = dataclasses.replace(
                    kw.get("kernel_options", DecodeKernelOptions()), pdl=False)
        rc = {side: RolloutConfig(max_new_tokens=R, temperature=1.0, max_batch_size=B,
                                  stop_token_ids=stop, decode_kernels=args.decode_kernels, **kw)
              for side, kw in sides.items()}
        run = lambda side: gen.generate(prompts, cfg=rc[side], eos_id=-1, pad_id=0,  # noqa
                                        seed=0)
        res = {}
        for side in sides:
            gen.release()
            first_s, out = timed(lambda: run(side), device, 1)
            res[side] = {"first_s": first_s, "s_all": [], "stats": dict(gen.stats),
                         "lengths": lengths(out, R)}
        for _ in range(args.reps):
            for side in sides:
                timed(lambda: run(side), device, 1, res[side]["s_all"])
        again = run("on")
        res["on"]["reproducible"] = bool(torch.equal(again.response_ids, run("on").response_ids))
        for side in sides:
            res[side]["s"] = statistics.median(res[side]["s_all"])
        for side in sides:
            if side != "off":
                res[side]["speedup"] = res["off"]["s"] / res[side]["s"]
                res[side]["speedup_first"] = res["off"]["first_s"] / res[side]["first_s"]
        res["speedup"] = res["off"]["s"] / res["on"]["s"]
        res["speedup_first"] = res["off"]["first_s"] / res["on"]["first_s"]
        report["results"][str(B)] = res
        print(json.dumps({B: res}, indent=1), flush=True)
    gen.release()
    write_json(args.out, report)
    for B, r in report["results"].items():
        print(f"B={B}: off {r['off']['s']:.3f} s, on {r['on']['s']:.3f} s (x{r['speedup']:.2f}); "
              f"first call off {r['off']['first_s']:.3f} s, on {r['on']['first_s']:.3f} s; "
              f"row-steps on/off {r['on']['stats']['decode_row_steps']}/"
              f"{r['off']['stats']['decode_row_steps']}")
        for side in ("window", "on_window"):
            if side in r:
                print(f"  {side}: {r[side]['s']:.3f} s (x{r[side]['speedup']:.2f}), first call "
                      f"{r[side]['first_s']:.3f} s")


if __name__ == "__main__":
    main()
