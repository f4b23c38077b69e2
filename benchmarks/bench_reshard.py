"""Train -> gen reshard of the actor on 2 GPUs (TP_t=2 -> TP_g=1), bf16, random init.

For each model shape (conf/model/<name>.yaml), in one run:
- ours: `Resharder.gather()` then `release()` (the transition train -> gen and back), for a few
  bucket sizes, plus the copy-then-in-place variant (`inplace=True`) and one without coalescing;
- plain: one NCCL `all_gather_into_tensor` of the same bytes (the floor), for bus bandwidth;
- naive: every TP-sharded parameter gathered separately into new tensors and concatenated;
- megatron: `megatron.core.resharding.swap_model_weights(src, dst, "nccl")` into a separate TP=1 model
  (its dst model is resident memory on top of the transient peak).
Every variant's weights are checked bit-identical to ours. Time: median over iterations of the max over
ranks, after warm-up, synchronised. Peak memory: `max_memory_allocated` above the level before the
transition. JSON (machine, versions, command, results) to --out.

  torchrun --nproc_per_node 2 --master_port 29511 benchmarks/bench_reshard.py \
      --models qwen2_1_5b qwen2_7b --out benchmarks/results/reshard_h200x2.json
CPU smoke test (gloo, fp32): add `--models tiny --iters 2`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridflow.config import ModelConfig  # noqa: E402
from hybridflow.parallel import groups  # noqa: E402
from hybridflow.parallel import param_rules as pr  # noqa: E402
from hybridflow.parallel.layout import Layout  # noqa: E402
from hybridflow.parallel.reshard import Resharder, _all_gather  # noqa: E402
from run_record import write_json  # noqa: E402

GB = 1e9
CUDA = torch.cuda.is_available()


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _timed(fn, *, iters: int, warmup: int) -> float:
    """Median seconds over iterations of the slowest rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, device=groups.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


class _Mem:
    """Peak and retained bytes allocated above the level at entry (CUDA only; zeros on CPU)."""

    def __enter__(self):
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated() if CUDA else 0
        return self

    def __exit__(self, *exc):
        _sync()
        self.peak = (torch.cuda.max_memory_allocated() - self.base) if CUDA else 0
        self.retained = (torch.cuda.memory_allocated() - self.base) if CUDA else 0


def _load_cfg(name: str, tp: int) -> ModelConfig:
    from hybridflow.models.build import padded_vocab_size

    path = os.path.join(os.path.dirname(__file__), "..", "hybridflow", "conf", "model", f"{name}.yaml")
    with open(path) as f:
        cfg = ModelConfig(**yaml.safe_load(f))
    # pad the vocabulary once for TP_t so the TP=1 megatron target has the same rows as our gen shard
    return dataclasses.replace(cfg, vocab_size=padded_vocab_size(cfg.vocab_size, tp))


def _naive(params: dict, tp_group, tp: int) -> dict:
    out = {}
    for name, p in params.items():
        if pr.param_rule(name) == pr.REPLICATED:
            out[name] = p.detach()
            continue
        parts = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(parts, p.detach(), group=tp_group)
        out[name] = pr.merge_shards(name, parts)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def bench_model(name: str, *, tp: int, precision: str, iters: int, warmup: int,
                bucket_mbs: list) -> dict:
    from megatron.core import parallel_state as ps

    from hybridflow.models.build import build_model

    world = dist.get_world_size()
    cfg = _load_cfg(name, tp)
    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=0)
    t0 = time.perf_counter()
    src = build_model(cfg, role="actor", ctx=ctx, precision=precision)
    tp_group = ps.get_tensor_model_parallel_group()
    params = dict(src.named_parameters())
    res = {"model": name, "params": sum(p.numel() for p in params.values()) * tp,
           "train_shard_gb": sum(p.numel() * p.element_size() for p in params.values()) / GB}
    lay = Layout(world_size=world, tp_t=tp, pp_t=1, tp_g=1)
    rgroups = groups.new_reshard_groups(lay)
    ref = None
    res["ours"] = []
    variants = ([dict(bucket_mb=mb) for mb in bucket_mbs]
                + [dict(bucket_mb=512.0, inplace=True), dict(bucket_mb=512.0, coalesce=False)])
    for opts in variants:
        r = Resharder(src, layout=lay, groups=rgroups, **opts)
        out = r.gather()
        ok = ref is None or _same(out, ref)
        ref = ref if ref is not None else {k: v.clone() for k, v in out.items()}
        del out
        r.release()
        # gather and release timed separately, each iteration a full transition
        g_times, r_times = [], []
        for it in range(warmup + iters):
            dist.barrier()
            _sync()
            t1 = time.perf_counter()
            out = r.gather()
            _sync()
            t2 = time.perf_counter()
            del out
            r.release()
            _sync()
            t3 = time.perf_counter()
            if it >= warmup:
                g_times.append(t2 - t1)
                r_times.append(t3 - t2)
        t = torch.tensor([g_times, r_times], device=groups.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        gather_s, release_s = statistics.median(t[0].tolist()), statistics.median(t[1].tolist())
        with _Mem() as m:
            out = r.gather()
        gen_bytes = r.allocated_bytes()
        del out
        r.release()
        left = (torch.cuda.memory_allocated() - m.base) if CUDA else 0
        res["ours"].append({"bucket_mb": opts["bucket_mb"], "inplace": r.inplace,
                            "coalesce": r.coalesce, "buckets": len(r.plan.buckets), "bit_identical": ok,
                            "gather_ms": gather_s * 1e3, "release_ms": release_s * 1e3,
                            "transition_ms": (gather_s + release_s) * 1e3,
                            "peak_gb": m.peak / GB, "gen_buffers_gb": gen_bytes / GB,
                            "busbw_gbps": gen_bytes * (tp - 1) / tp / gather_s / GB,
                            "left_after_release_gb": left / GB})
        del r
    # plain all-gather of the same bytes
    nbytes = res["ours"][0]["gen_buffers_gb"] * GB
    elem = torch.empty((), dtype=next(iter(params.values())).dtype).element_size()
    n = int(nbytes // elem) // tp * tp
    buf = torch.empty(n, dtype=next(iter(params.values())).dtype, device=groups.device())
    mine = buf.narrow(0, dist.get_rank(tp_group) * (n // tp), n // tp)
    plain_s = _timed(lambda: _all_gather(buf, mine, group=tp_group), iters=iters, warmup=warmup)
    res["plain_allgather"] = {"gb": n * elem / GB, "ms": plain_s * 1e3,
                              "busbw_gbps": n * elem * (tp - 1) / tp / plain_s / GB}
    del buf, mine
    # naive per-parameter gather
    with _Mem() as m:
        naive = _naive(params, tp_group, tp)
    ok = _same(naive, ref)
    del naive
    naive_s = _timed(lambda: _naive(params, tp_group, tp), iters=iters, warmup=min(warmup, 1))
    res["naive"] = {"ms": naive_s * 1e3, "peak_gb": m.peak / GB, "bit_identical": ok}
    # megatron-core's swap_model_weights into a separate TP=1 model
    res["megatron_swap"] = _bench_megatron(src, cfg, ref, precision=precision, iters=iters,
                                           warmup=warmup)
    res["build_and_bench_s"] = time.perf_counter() - t0
    best = min(res["ours"], key=lambda r: r["transition_ms"])
    res["summary"] = {"ours_best_bucket_mb": best["bucket_mb"],
                      "ours_vs_plain": best["gather_ms"] / res["plain_allgather"]["ms"],
                      "ours_vs_naive_time": best["transition_ms"] / res["naive"]["ms"],
                      "ours_vs_megatron_time": best["transition_ms"] / res["megatron_swap"]["ms"]}
    del src, params, ref
    return res


def _bench_megatron(src, cfg, ref, *, precision: str, iters: int, warmup: int) -> dict:
    from megatron.core.resharding import swap_model_weights

    from hybridflow.models.build import build_model

    backend = "nccl" if CUDA else "gloo"
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)  # the target model's groups (src keeps its own)
    with _Mem() as resident:
        dst = build_model(cfg, role="actor", ctx=ctx, precision=precision)
    t0 = time.perf_counter()
    swap_model_weights(src, dst, backend)  # first call builds and caches the plan
    plan_s = time.perf_counter() - t0
    ok = _same({n: p.detach() for n, p in dst.named_parameters()}, ref)
    with _Mem() as m:
        swap_model_weights(src, dst, backend)
    swap_s = _timed(lambda: swap_model_weights(src, dst, backend), iters=iters, warmup=warmup)
    del dst
    return {"ms": swap_s * 1e3, "first_call_with_plan_s": plan_s, "bit_identical": ok,
            "transient_peak_gb": m.peak / GB, "dst_model_resident_gb": resident.retained / GB,
            "peak_gb": (m.peak + resident.retained) / GB}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen2_1_5b", "qwen2_7b"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[256.0, 512.0, 1024.0, 2048.0])
    ap.add_argument("--out", default="benchmarks/results/reshard_h200x2.json")
    args = ap.parse_args()
    groups.init_distributed()
    tp = dist.get_world_size()
    precision = "bf16" if CUDA else "fp32"
    results = []
    for name in args.models:
        r = bench_model(name, tp=tp, precision=precision, iters=args.iters, warmup=args.warmup,
                        bucket_mbs=args.bucket_mb)
        results.append(r)
        if dist.get_rank() == 0:
            print(json.dumps(r, indent=1), flush=True)
        if CUDA:
            torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            _write(args, tp, precision, results)
    if dist.get_rank() == 0:
        _table(results)
    groups.destroy()


def _write(args, tp: int, precision: str, results: list) -> None:
    import megatron.core

    doc = {"benchmark": "reshard train TP_t=%d -> gen TP_g=1 (PP=1)" % tp,
           "dtype": precision, "world_size": tp,
           "machine": {"gpu": torch.cuda.get_device_name() if CUDA else "cpu",
                       "gpus": torch.cuda.device_count() if CUDA else 0, "host": platform.node()},
           "versions": {"torch": torch.__version__, "python": platform.python_version(),
                        "nccl": _nccl_version(),
                        "megatron_core": getattr(megatron.core, "__version__", "?")},
           "command": "torchrun --nproc_per_node %d %s" % (tp, " ".join(sys.argv)),
           "results": results}
    write_json(args.out, doc)


def _nccl_version():
    if not CUDA:
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _table(results: list) -> None:
    print("%-11s %-9s %8s %8s %8s %8s | %8s %8s %8s %8s" % (
        "model", "variant", "ms", "peak_GB", "busbw", "x_plain", "naive_ms", "naive_GB",
        "mcore_ms", "mcore_GB"), flush=True)
    for r in results:
        p, nv, mc = r["plain_allgather"], r["naive"], r["megatron_swap"]
        for o in r["ours"]:
            print("%-11s %-9s %8.2f %8.2f %8.1f %8.2f | %8.2f %8.2f %8.2f %8.2f" % (
                r["model"], "b%g%s%s" % (o["bucket_mb"], "ip" if o["inplace"] else "",
                                         "" if o["coalesce"] else "nc"),
                o["transition_ms"], o["peak_gb"], o["busbw_gbps"], o["gather_ms"] / p["ms"],
                nv["ms"], nv["peak_gb"], mc["ms"], mc["peak_gb"]))
        print("%-11s %-9s %8.2f %8s %8.1f" % (r["model"], "plain", p["ms"], "", p["busbw_gbps"]))


if __name__ == "__main__":
    main()
