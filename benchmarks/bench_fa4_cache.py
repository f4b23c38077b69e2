"""FlashAttention-4's on-disk compile cache (models/attention.fa4_compile_cache_env): what a
process pays for its first packed-attention call with the cache cold, warm, and off, and whether
the kernels a warm process loads compute what a compiling one computes.

Each case runs in a fresh process (`--child`), in this order, on one empty cache folder:
- `off`: FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 (what every process paid before);
- `cold`: hybridflow's default (nothing set but XDG_CACHE_HOME, the cache on in its folder),
  empty: compiles and writes;
- `warm`, `warm2`: the same, filled: loads.
A child imports flash-attn-4 through hybridflow (the import is part of its first-call time), builds
one packed row of --docs documents on the packing's views (Qwen2.5-Coder-0.5B's heads: 14 query,
2 K/V, head_dim 64, bf16) and times its first forward + backward and the median of --reps more,
then writes a hash of the forward's output bytes, which must be equal across the cases, and the
gradients' sums (the backward accumulates dQ with atomics: equal to rounding).

    python benchmarks/bench_fa4_cache.py --out benchmarks/results/fa4_compile_cache_h100.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from run_record import command, machine, versions, write_json  # noqa: E402

CASES = ("off", "cold", "warm", "warm2")


def child(a) -> dict:
    t0 = time.perf_counter()
    import torch

    from hybridflow.models import attention

    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 2 * a.mean_len, (a.docs,), generator=gen)
    cu = torch.zeros(a.docs + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1])
    dev = torch.device("cuda")
    q, k, v = (torch.randn(total, h, 64, generator=gen).to(dev, torch.bfloat16).requires_grad_()
               for h in (14, 2, 2))
    kernel, why = attention.choose_packed_attention("fa4", device=dev, dtype=torch.bfloat16,
                                                    head_dim=64)
    doc_ids = torch.repeat_interleave(torch.arange(a.docs), lens).to(dev)
    docs = attention.packed_documents(doc_ids, cu.to(dev), int(lens.max()), kernel=kernel)

    def step():
        out = attention.fa4_packed_attention(q, k, v, docs, scale=0.125)
        out.float().square().mean().backward()
        return out

    out = step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    times = []
    for _ in range(a.reps):
        for t in (q, k, v):
            t.grad = None
        t1 = time.perf_counter()
        out = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t1)
    return {"first_call_s": round(first, 3), "steady_ms": round(1e3 * statistics.median(times), 3),
            "out_sha": hashlib.sha256(out.detach().view(torch.int16).cpu().numpy()).hexdigest(),
            "grad_sums": [float(t.grad.float().sum()) for t in (q, k, v)],
            "cache_env": {key: os.environ.get(key) for key in (attention.FA4_CACHE_ENV,
                                                               attention.FA4_CACHE_DIR_ENV)},
            "tokens": total, "why": why}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--mean-len", type=int, default=400)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/fa4_compile_cache.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    cache = tempfile.mkdtemp(prefix="fa4_cache_")
    record = {"benchmark": "flash-attn-4 first packed forward + backward per fresh process, "
                           "compile cache off / cold / warm",
              "machine": machine(), "command": command(),
              "versions": versions("flash-attn-4", "nvidia-cutlass-dsl", "triton"),
              "setup": {"docs": a.docs, "mean_len": a.mean_len, "reps": a.reps, "heads": [14, 2],
                        "head_dim": 64, "dtype": "bf16", "cache_dir": cache}, "cases": {}}
    for name in CASES:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTENTION_CUTE_DSL")}
        env["XDG_CACHE_HOME"] = cache
        if name == "off":
            env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                              "--docs", str(a.docs), "--mean-len", str(a.mean_len),
                              "--reps", str(a.reps)], env=env, capture_output=True, text=True)
        if run.returncode:
            record["cases"][name] = {"error": run.stderr[-2000:]}
        else:
            record["cases"][name] = json.loads(run.stdout.strip().splitlines()[-1])
        record["cache_files"] = sum(len(f) for _, _, f in os.walk(cache))
        print(name, {k: v for k, v in record["cases"][name].items() if k != "cache_env"},
              flush=True)
        write_json(a.out, record)
    shas = [c.get("out_sha") for c in record["cases"].values()]
    record["same_results"] = all(s == shas[0] for s in shas) and shas[0] is not None
    write_json(a.out, record)
    print("same results in every case:", record["same_results"])


if __name__ == "__main__":
    main()
