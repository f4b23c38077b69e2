"""The actor update with LoRA against the full-parameter update, through the real Engine.

One GSM8K-like update (rows with prompts of --prompt-len and log-normal responses of mean --mean,
cut at --cap; random weights of --model, --layers / --vocab to shrink it) runs as packed token-budget
micro-batches of --budget tokens through `Engine.train_step`, once with every parameter training and
once with LoRA adapters (rank --rank, alpha --alpha, --targets; the base frozen). Per side: seconds
per update (median of --iters after a warm-up), split into the forward + backward of the
micro-batches and the rest (optimizer step, grad-norm, zeroing); for LoRA, the switch around
generation on the trained adapters (the merge into the weights and the restore); and the
adapter path taken
(`fused`: models/lora.py's one-node linears with the gradients added into DDP's main_grad, or
`autograd`). A side named `<side>+graphs` (e.g. --sides full,lora,full+graphs,lora+graphs) runs
with parallel.train_cuda_graphs: its packed micro-batches padded to one shape and each layer's
forward and backward replayed as CUDA graphs (models/graphs.py). With --profile: per phase
(forward, backward, optimizer, finite-check, zero) the top-level aten ops and, on CUDA, the kernels and their summed device time (a pass whose kernel time
is far below its wall time waits on the host: launch-bound), also per layer (forward and backward:
per layer and micro-batch).

  python benchmarks/bench_lora_update.py --profile --out benchmarks/results/lora_update_h200.json
      # one H200, < 2 min: Qwen2.5-Coder-0.5B, 512 rows (~220k tokens), budget 20,480
  python benchmarks/bench_lora_update.py --device cpu --layers 2 --vocab 4096 --rows 8 \\
      --prompt-len 16 --mean 48 --min 16 --cap 96 --budget 1024 --iters 2 --profile \\
      --out /tmp/lora_update.json                                            # CPU smoke, ~1 min
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import os
import statistics
import sys
import time
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_packed_pass import (add_length_args, gsm8k_lengths, make_batch,  # noqa: E402
                                          timed)
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "finite", "zero")


def _labelled(obj, name: str, label: str, cuda: bool, spent: dict) -> None:
    """obj.name runs under a profiler label and adds its wall seconds to spent[label]."""
    from torch.profiler import record_function

    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with record_function(f"PH_{label}"):
            out = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        return out
    setattr(obj, name, wrapped)


def _phase(event) -> tuple[str | None, bool]:
    """(the PH_ label above a profiler event or None, whether it ran inside another aten op)."""
    p, nested, backward = event.cpu_parent, False, False
    while p is not None:
        if p.name.startswith("aten::"):
            nested = True
        if p.name.startswith("autograd::engine::evaluate_function"):
            backward = True
        if p.name.startswith("PH_"):
            label = p.name[3:]
            return ("backward" if backward else "forward") if label == "fwdbwd" else label, nested
        p = p.cpu_parent
    return None, nested


def profile_update(fn, cuda: bool, layers: int, micro_batches: int) -> dict:
    """Per phase: top-level aten ops (and, on CUDA, kernels and their device seconds), also per
    layer and micro-batch (the phase's whole count over layers x micro-batches: the embedding, head
    and loss ops included, a small share at a real depth)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    ops = collections.defaultdict(collections.Counter)
    kernels, kernel_s = collections.Counter(), collections.Counter()
    by_name, by_name_n = collections.Counter(), collections.Counter()  # every kernel, any thread
    runtime, runtime_n = collections.Counter(), collections.Counter()  # cuda* API calls (host)
    for e in prof.events():
        if e.name.startswith("cuda") and not e.name.startswith("cuda::"):
            runtime[e.name] += e.cpu_time_total / 1e6
            runtime_n[e.name] += 1
        for k in getattr(e, "kernels", ()):
            by_name[k.name[:120]] += k.duration / 1e6
            by_name_n[k.name[:120]] += 1
        if e.name.startswith("aten::"):
            phase, nested = _phase(e)
            if phase is not None and not nested:
                ops[phase][e.name[6:]] += 1
        if cuda:
            for k in getattr(e, "kernels", ()):  # launched under this CPU op
                phase, _ = _phase(e) if not e.name.startswith("PH_") else (e.name[3:], False)
                phase = phase or "other"
                kernels[phase] += 1
                kernel_s[phase] += k.duration / 1e6
    out = {}
    if cuda:  # backward runs on autograd's device thread, outside the PH_ labels: all kernels here
        out["all_kernels"] = {"kernels": sum(by_name_n.values()), "kernel_s": sum(by_name.values()),
                              "top": {n: [by_name_n[n], t] for n, t in by_name.most_common(25)}}
        out["cuda_api"] = {n: [runtime_n[n], t] for n, t in runtime.most_common(12)}
        self_cpu = sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:20]
        out["top_self_cpu"] = {k.key: [k.count, k.self_cpu_time_total / 1e6] for k in self_cpu}
    for phase in PHASES:
        c = ops.get(phase, collections.Counter())
        per = layers * (micro_batches if phase in ("forward", "backward") else 1)
        out[phase] = {"aten_ops": sum(c.values()), "aten_ops_per_layer": sum(c.values()) / per,
                      "top_ops": dict(c.most_common(12))}
        if cuda:
            out[phase].update(kernels=kernels[phase], kernels_per_layer=kernels[phase] / per,
                              kernel_s=kernel_s[phase])
    return out


def switch_seconds(module, reps: int, cuda: bool) -> dict:
    """The LoRA switch around generation on the adapters the updates trained: the merge into the
    weights (`merged_adapters` entered) and the restore (left), medians of `reps`, synchronized."""
    from hybridflow.models.lora import merged_adapters

    def now():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    merge, restore = [], []
    for _ in range(reps + 1):  # the first: warm-up
        t0 = now()
        switch = merged_adapters(module)
        switch.__enter__()
        t1 = now()
        switch.__exit__(None, None, None)
        t2 = now()
        merge.append(t1 - t0)
        restore.append(t2 - t1)
    return {"merge_median_s": statistics.median(merge[1:]),
            "restore_median_s": statistics.median(restore[1:])}


def main(argv=None) -> int:
    from hybridflow.config import AlgoConfig, LoRAConfig, OptimConfig, ParallelConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2_5_coder_0_5b")
    ap.add_argument("--layers", type=int, default=0, help="0: the model's")
    ap.add_argument("--vocab", type=int, default=0, help="0: the model's")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--precision", default=None, help="bf16 (CUDA default) or fp32 (CPU default)")
    add_length_args(ap)
    ap.add_argument("--budget", type=int, default=20480)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--targets", default="all-linear")
    ap.add_argument("--sides", default="full,lora",
                    help="comma-separated: full, lora, full+graphs, lora+graphs")
    ap.add_argument("--graphs-min-fill", type=float, default=ParallelConfig.train_graphs_min_fill,
                    help="parallel.train_graphs_min_fill for the +graphs sides: packed "
                         "micro-batches under this share of the budget run eager (0: all padded)")
    ap.add_argument("--recompute", action="store_true",
                    help="parallel.activation_checkpointing=true (every layer's forward again in "
                         "the backward; not with the +graphs sides)")
    ap.add_argument("--no-fusion", action="store_true",
                    help="parallel.gradient_accumulation_fusion=false (LoRA: the autograd path)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from hybridflow.algo.objectives import actor_objective
    from hybridflow.cost.shapes import load_shape
    from hybridflow.engine import Engine
    from hybridflow.parallel import groups

    cuda = a.device == "cuda"
    precision = a.precision or ("bf16" if cuda else "fp32")
    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    shape = {"attention_backend": "sdpa"}
    if a.layers:
        shape["num_layers"] = a.layers
    if a.vocab:
        shape["vocab_size"] = a.vocab
    model_cfg = dataclasses.replace(load_shape(a.model), **shape)
    lengths = gsm8k_lengths(a)
    a.rows = len(lengths)  # --lengths-from: the step's own rows
    batch = make_batch(a.prompt_len, lengths, model_cfg.vocab_size, ids=a.ids)
    algo = AlgoConfig(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.001)
    loss_fn = actor_objective(algo, num_tokens=int(batch.response_mask.sum()), num_seqs=a.rows)
    results = {}
    for side in a.sides.split(","):
        kind, _, option = side.partition("+")
        if kind not in ("full", "lora") or option not in ("", "graphs"):
            raise SystemExit(f"--sides: {side!r} is not one of full, lora, full+graphs, lora+graphs")
        par = ParallelConfig(use_distributed_optimizer=False, train_cuda_graphs=option == "graphs",
                             activation_checkpointing=a.recompute,
                             gradient_accumulation_fusion=not a.no_fusion,
                             train_graphs_min_fill=a.graphs_min_fill)
        lora = LoRAConfig(rank=a.rank, alpha=a.alpha, target_modules=a.targets.split(",")) \
            if kind == "lora" else None
        eng = Engine(role="actor", model_cfg=model_cfg, ctx=ctx, parallel=par, precision=precision,
                     optim=OptimConfig(lr=5e-5 if lora else 3e-6, clip_grad=1.0),
                     total_updates=1000, lora=lora, packed_attention="auto")
        spent: dict = {}
        _labelled(eng, "_run", "fwdbwd", cuda, spent)
        _labelled(eng.optimizer, "step", "optimizer", cuda, spent)
        _labelled(eng, "_grads_finite", "finite", cuda, spent)
        _labelled(eng.model, "zero_grad_buffer", "zero", cuda, spent)

        def upd():
            eng.train_step(batch, loss_fn, micro_batch_size=a.rows, max_tokens=a.budget, pack=True,
                           need_entropy=True)

        micro, _ = eng._micro_batches(batch, micro_batch_size=a.rows, max_tokens=a.budget, pack=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        fwdbwd = []

        def upd_split():  # one update, its forward + backward seconds kept
            spent.clear()
            upd()
            fwdbwd.append(spent["fwdbwd"])

        times = timed(upd_split, a.iters, cuda)  # after a warm-up: compiles, allocator
        fwdbwd = fwdbwd[1:]  # the warm-up's left out
        r = {"update_s": times, "update_median_s": statistics.median(times),
             "fwd_bwd_median_s": statistics.median(fwdbwd),
             "rest_median_s": statistics.median(t - f for t, f in zip(times, fwdbwd)),
             "micro_batches": len(micro),
             "tokens": sum(int(p.input_ids.numel()) if p is not None else int(mb.input_ids().numel())
                           for mb, _, p in micro),
             "trainable_params": sum(p.numel() for p in eng.module.parameters() if p.requires_grad),
             "trainable_tensors": sum(1 for p in eng.module.parameters() if p.requires_grad)}
        if cuda:  # allocator retries (cudaFree + malloc under memory pressure) would stall a pass
            stats = torch.cuda.memory_stats()
            r.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                     peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                     alloc_retries=stats.get("num_alloc_retries", 0),
                     graphed_micro_batches=eng.graphed,
                     graph_shape=str(eng._graph_shape) if eng._graph_shape else None)
            before = torch.cuda.memory_stats().get("num_device_alloc", 0)
            torch.cuda.set_sync_debug_mode(1)  # warns at every synchronizing call
            import warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                upd()
                torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(0)
            syncs = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                                        if "synchroniz" in str(w.message))
            r.update(device_mallocs_per_update=torch.cuda.memory_stats().get("num_device_alloc", 0)
                     - before, syncs_per_update=dict(syncs.most_common(8)))
            print(f"{side}: {r['device_mallocs_per_update']} cudaMallocs, syncs "
                  f"{sum(syncs.values())}: {dict(syncs.most_common(4))}", flush=True)
        if lora:
            from hybridflow.models.lora import adapters

            r.update(switch_seconds(eng.module, max(3, a.iters), cuda))
            linear, ad = next(adapters(eng.module))
            with torch.enable_grad():
                fused = getattr(ad, "fusable", None)
                r["adapter_path"] = "fused" if fused and fused(linear, linear.weight, None) \
                    else "autograd"
        if a.profile:
            with contextlib.redirect_stdout(sys.stderr):
                r["profile"] = profile_update(upd, cuda, model_cfg.num_layers, len(micro))
        results[side] = r
        print(f"{side:11s} update {r['update_median_s']:.3f} s (fwd+bwd {r['fwd_bwd_median_s']:.3f}, "
              f"rest {r['rest_median_s']:.3f}), {r['micro_batches']} micro-batches, "
              f"{r['tokens']} tokens" + (f", adapters {r.get('adapter_path')}, merge "
                                         f"{r['merge_median_s']:.4f} s, restore "
                                         f"{r['restore_median_s']:.4f} s" if lora else ""),
              flush=True)
        if a.profile:
            for phase, p in r["profile"].items():
                if phase in ("cuda_api", "top_self_cpu"):
                    print(f"   {phase}:", flush=True)
                    for n, (c, t) in list(p.items())[:12]:
                        print(f"     {t:7.3f} s {c:6d}x {n[:90]}", flush=True)
                    continue
                if phase == "all_kernels":
                    print(f"   all kernels: {p['kernels']} launches, {p['kernel_s']:.3f} s",
                          flush=True)
                    for n, (c, t) in list(p["top"].items())[:15]:
                        print(f"     {t:7.3f} s {c:6d}x {n[:90]}", flush=True)
                    continue
                extra = (f", {p['kernels_per_layer']:.0f} kernels/layer, {p['kernel_s']:.3f} s "
                         "kernels") if cuda else ""
                print(f"   {phase:9s} {p['aten_ops_per_layer']:6.1f} ops/layer{extra}", flush=True)
        # the engine sits in reference cycles (its wrapped methods, the update closure, DDP's
        # hooks): without a collection the next side's peak would count its weights, gradients
        # and optimizer state too
        gone = weakref.ref(eng)
        del eng, upd, upd_split
        gc.collect()
        r["engine_freed"] = gone() is None
        if cuda:
            torch.cuda.empty_cache()
    for opt in ("", "+graphs"):
        if "full" + opt in results and "lora" + opt in results:
            results["lora_over_full" + opt.replace("+", "_")] = (
                results["lora" + opt]["update_median_s"] / results["full" + opt]["update_median_s"])
    write_json(a.out, {"benchmark": "LoRA vs full-parameter actor update", "model": a.model,
                       "layers": model_cfg.num_layers, "vocab": model_cfg.vocab_size,
                       "precision": precision, "machine": machine(),
                       "versions": versions("megatron-core"), "command": command(),
                       "lora": {"rank": a.rank, "alpha": a.alpha, "targets": a.targets},
                       "lengths": {"rows": a.rows, "prompt_len": a.prompt_len,
                                   "response_mean": statistics.fmean(lengths),
                                   "response_max": max(lengths)},
                       "budget": a.budget, "results": results})
    print(f"wrote {a.out}")
    groups.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
