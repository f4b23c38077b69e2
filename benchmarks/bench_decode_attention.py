"""Launch parameters of the split-KV decode attention kernel (rollout.decode_kernels=triton).

Times `hybridflow.kernels.layer_ops.decode_attention` alone, replayed in a CUDA graph (as a decode step
runs it), at the decode shapes of the speed issue's workloads (Qwen2-0.5B / 1.5B, batch 64 / 256,
a cache of prompt 128 + 256 new columns attended over its first --columns, each count timed and
the mean ranked), for every combination of BLOCK_T, warps, pipeline stages and programs per SM.
Rank by the columns a decode attends: one count misleads (a sweep at 256 columns alone favoured
128-column blocks, which lost in the decode itself, decode_profile_h200_block128_tried.json; likely
because its 64-column windows leave a 128-column block half empty at 192 or 320 columns). Prints
the best per shape and its K/V read bandwidth; the JSON keeps every timing. The module's defaults
are the row marked `default`.

    python benchmarks/bench_decode_attention.py --out benchmarks/results/decode_attention_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_generate import COPY_BW, machine  # noqa: E402
from gsm8k_hf_eval import write_json  # noqa: E402  (temp file + os.replace)
from hybridflow.kernels import layer_ops as kern  # noqa: E402

# (name, rows, query groups, heads per group, head_dim)
SHAPES = (("qwen2_0_5b_b64", 64, 2, 7, 64), ("qwen2_0_5b_b256", 256, 2, 7, 64),
          ("qwen2_1_5b_b64", 64, 2, 6, 128), ("qwen2_1_5b_b256", 256, 2, 6, 128))
GRID = dict(block_t=(32, 64, 128), warps=(2, 4), stages=(2, 3), per_sm=(2, 4, 8))


def time_us(fn, reps: int = 50) -> float:
    """Median microseconds of one call, `reps` calls captured in a CUDA graph per replay."""
    fn()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--columns", type=int, nargs="+", default=[128, 192, 256, 320, 384],
                    help="attended cache columns (kv_len), each timed; a config's `us` is the mean "
                         "over them (default: the 64-column windows a 128 + 256 decode attends)")
    ap.add_argument("--cache", type=int, default=384, help="cache columns (T of the buffer)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention.py times Triton kernels in CUDA graphs: it needs a GPU")
    if max(args.columns) > args.cache:
        sys.exit(f"--columns {max(args.columns)} exceeds --cache {args.cache}")
    dev = torch.device("cuda")
    default = (kern.BLOCK_T, kern.ATTN_WARPS, kern.ATTN_STAGES, kern.PROGRAMS_PER_SM)
    results = {}
    # rewritten after every shape: a sweep cut off by a device call's time limit keeps its shapes
    record = dict(benchmark="split-KV decode attention launch sweep", columns=args.columns,
                  cache=args.cache, grid=GRID, default=default, shapes=results,
                  machine=machine(dev),
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv))
    for name, B, G, hpg, hd in SHAPES:
        kc = torch.randn(B, G, args.cache, hd, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(B, G, hpg, hd, device=dev, dtype=torch.bfloat16)
        valid = torch.ones(B, args.cache, dtype=torch.bool, device=dev)
        views = {c: (kc[:, :, :c], vc[:, :, :c], valid[:, :c]) for c in args.columns}
        refs = {c: kern.decode_attention(q, *views[c], impl="torch") for c in args.columns}
        # K and V bytes, mean over the column counts
        read = 2 * B * G * sum(args.columns) / len(args.columns) * hd * 2
        rows = []
        for bt, warps, stages, per_sm in itertools.product(*GRID.values()):
            kern.BLOCK_T, kern.ATTN_WARPS, kern.ATTN_STAGES, kern.PROGRAMS_PER_SM = \
                bt, warps, stages, per_sm
            cfg = dict(block_t=bt, warps=warps, stages=stages, per_sm=per_sm)
            try:
                err, by_col = 0.0, {}
                for c in args.columns:
                    out = kern.decode_attention(q, *views[c], impl="triton")
                    err = max(err, float((out.float() - refs[c].float()).abs().max()))
                    by_col[c] = time_us(lambda: kern.decode_attention(q, *views[c],
                                                                      impl="triton"))
            except Exception as e:  # a launch the device cannot run (shared memory): skipped
                rows.append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:120]}"))
                continue
            rows.append(dict(cfg, us=sum(by_col.values()) / len(by_col), us_by_columns=by_col,
                             max_abs_err=err,
                             splits={c: kern.num_splits(B * G, c, dev) for c in args.columns},
                             default=(bt, warps, stages, per_sm) == default))
        kern.BLOCK_T, kern.ATTN_WARPS, kern.ATTN_STAGES, kern.PROGRAMS_PER_SM = default
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        dflt = next(r for r in ok if r["default"])
        torch_us = sum(time_us(lambda: kern.decode_attention(q, *views[c], impl="torch"))
                       for c in args.columns) / len(args.columns)
        results[name] = dict(rows=B, groups=G, heads_per_group=hpg, head_dim=hd,
                             kv_read_bytes=read, floor_us=read / COPY_BW * 1e6, best=best,
                             default=dflt, torch_sdpa_us=torch_us, all=rows)
        print(f"{name:18s} floor {read / COPY_BW * 1e6:6.1f} us  sdpa {torch_us:6.1f}  default "
              f"{dflt['us']:6.1f}  best {best['us']:6.1f} ({best['block_t']}, {best['warps']}w, "
              f"{best['stages']}s, {best['per_sm']}/SM)  err {best['max_abs_err']:.3g}",
              flush=True)
        write_json(args.out, record)


if __name__ == "__main__":
    main()
