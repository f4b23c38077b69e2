"""trainer.profile_steps: torch.profiler around chosen training steps (torchtitan's
`profiling.profile_freq`, verl's per-step profiler), as a step consumer.

Each profiled step writes, per rank, under `trainer.profile_dir` (default <output_dir>/profile):
- `step<N>_rank<R>.trace.json.gz`: the Chrome / Perfetto trace (CPU ops, CUDA kernels, and one
  `stage/<name>` range per StageTimer stage: gen, ref, update_actor, ...);
- `step<N>_rank<R>.json`: per stage its wall seconds, the seconds of device kernels that ran inside
  it and their count, and its top kernels; the stages wait for the current stream at their edges
  (StageTimer), so a kernel belongs to the stage whose range holds it. kernel_s / wall_s says
  whether a stage is bound by the device (near 1) or by the host launching it; `idle_s` is the
  stage's time with no kernel running, and `waits` charges each idle gap to the host ops that
  launched the kernel ending it (what the device waited for: "aten::mm < aten::linear < ...",
  innermost first; "(stage end)" for host work after the stage's last kernel), and
  `idle_by_phase` sums the same gaps by the engine range the launch came from (engine.forward,
  engine.optimizer, ...; "backward" for autograd's thread, "host" for the stage's own host work
  outside the engine's ranges); `host_waits` lists where the host was held by the CUDA runtime
  inside the stage (stream / device / event synchronizations and synchronous copies: an
  `.item()`, a copy to or from pageable host memory; the caching allocator's cudaMalloc of a new
  block and cudaFree), each with its op chain (and, with `trainer.profile_with_stack`, the
  Python lines), the seconds it took and how often: a synchronization leaves the device nothing
  queued until the host launches again, a slow allocation lets the queue run dry;
- `step<N>_rank<R>.txt`: torch's operator table, sorted by device time (CPU time on CPU).
`python -m hybridflow.profiling <trace>` prints the per-stage summary of a saved trace.
All files are written to a temporary name and renamed. Steps are counted as the logger counts
them (the first step is 1); a profile starts after the previous step's logging and validation.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from hybridflow.atomic import atomic_write

STAGE_PREFIX = "stage/"


class StepProfiler:
    """Step consumer: profiles the steps in `steps` (1-based, as logged)."""

    save_on_stop = True

    def __init__(self, steps, out_dir: str, *, start_step: int, rank: int, top: int = 12,
                 with_stack: bool = False):
        self.steps, self.out_dir, self.rank, self.top = set(steps), out_dir, rank, top
        self.with_stack = with_stack
        self.prof = None
        self.step = None
        self._maybe_start(start_step + 1)

    def _maybe_start(self, step: int) -> None:
        if step not in self.steps:
            return
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self.prof, self.step = profile(activities=acts, with_stack=self.with_stack), step
        self.prof.start()

    def on_step(self, step: int, metrics: dict) -> bool:
        if self.prof is not None and step == self.step:
            self._finish()
        self._maybe_start(step + 1)
        return False

    def on_end(self) -> None:
        if self.prof is not None:  # the run stopped inside a profiled step's window
            self._finish()

    def _finish(self) -> None:
        prof, step = self.prof, self.step
        self.prof = self.step = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        base = os.path.join(self.out_dir, f"step{step}_rank{self.rank}")
        atomic_write(base + ".trace.json.gz", lambda p: _gzipped_trace(prof, p))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
        atomic_write(base + ".txt", lambda p: _write(p, table))
        summary = {"step": step, "rank": self.rank, "device": _device(),
                   "stages": stage_summary(prof.events(), top=self.top,
                                           launches=kernel_launches(prof),
                                           waits=host_waits(prof.events()))}
        atomic_write(base + ".json", lambda p: _write(p, json.dumps(summary, indent=1)))


def stage_summary(events, *, top: int = 12, launches: list | None = None,
                  waits: list | None = None) -> dict:
    """{stage: {wall_s, kernel_s, kernels, idle_s, top: [{kernel, s, calls}], waits, host_waits}}
    from profiler events: the `stage/<name>` CPU ranges and the device kernels inside each (by
    their device timestamps). `launches` [(start, end, name, launcher)] (kernel_launches): the
    kernels with the host ops that launched them, for each stage's `waits`; without it the
    kernels come from `events` and every wait is charged to "?". `waits` [(start, end, where)]
    (host_waits): the host's synchronizations, each in the stage whose range holds it."""
    stages, kernels = [], []
    for e in events:
        if e.name.startswith(STAGE_PREFIX) and not _on_device(e):  # its CPU range, not the
            stages.append((e.name[len(STAGE_PREFIX):], e.time_range.start,  # GPU-track copy
                           e.time_range.end))
        elif launches is None and _is_kernel(e):
            kernels.append((e.time_range.start, e.time_range.end, e.name))
    return _summarise(stages, kernels if launches is None else launches, top=top,
                      host=waits or [])


# CUDA runtime calls that hold the host: synchronizations, synchronous copies, and the caching
# allocator's own calls (a new block's cudaMalloc maps its pages while the host waits; cudaFree
# also synchronizes the device)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMalloc", "cudaFree")


def host_waits(events) -> list:
    """[(start, end, where)] of the runtime calls in HOST_WAITS among profiler `events` (host
    clock, us); `where`: the op chain that made the call (launch_chain), and the innermost
    Python lines of the profile's stacks (with_stack) after " @ "."""
    out = []
    for e in events:
        if e.name in HOST_WAITS and not _on_device(e):
            where = launch_chain(e.cpu_parent) if e.cpu_parent is not None else "?"
            lines = [f for f in (getattr(e, "stack", None) or []) if "hybridflow" in f]
            if lines:
                where += " @ " + " < ".join(lines[:3])
            out.append((e.time_range.start, e.time_range.end, where or "?"))
    return out


def trace_summary(trace: dict, *, top: int = 12) -> dict:
    """stage_summary from a saved Chrome trace (`traceEvents`: the stages' `user_annotation`
    ranges, the `kernel` / `gpu_memcpy` / `gpu_memset` events, each charged to the `cpu_op` of its
    "External id" for the waits, and the `cuda_runtime` calls of HOST_WAITS, charged alike, for
    the host waits); `python -m hybridflow.profiling TRACE` prints it."""
    stages, kernels, calls, ops = [], [], [], {}
    for e in trace["traceEvents"]:
        cat, name = e.get("cat"), e.get("name", "")
        if cat == "user_annotation" and name.startswith(STAGE_PREFIX):
            stages.append((name[len(STAGE_PREFIX):], e["ts"], e["ts"] + e["dur"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            xid = e.get("args", {}).get("External id")
            kernels.append((e["ts"], e["ts"] + e["dur"], name, xid))
        elif cat == "cuda_runtime" and name in HOST_WAITS:
            calls.append((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("External id")))
        elif cat == "cpu_op" and "External id" in e.get("args", {}):
            ops[e["args"]["External id"]] = name
    return _summarise(stages, [(a, b, n, ops.get(x, "?")) for a, b, n, x in kernels], top=top,
                      host=[(a, b, ops.get(x, "?")) for a, b, x in calls])


def kernel_launches(prof, *, frames=None) -> list:
    """[(start, end, name, launcher, phase)] of a finished torch.profiler's device kernels, in us
    on the clock of its host events; `launcher`: the host op that launched the kernel and the ops
    enclosing it, innermost first (launch_chain), or "?" where the link is missing; `phase`: the
    range it was launched from (launch_phase). `frames`
    (op -> str, e.g. the Python lines of a trace with stacks): appended to each launcher after
    " @ "."""
    from torch.autograd import DeviceType

    # a kernel's link is its launching op's id; the runtime calls (cuda*, cu*) have ids of their own
    ops = {e.id: e for e in prof.events() if e.device_type == DeviceType.CPU
           and not e.name.startswith("cu")}
    res = prof.profiler.kineto_results  # the raw events: their links on every torch version
    t0, out = res.trace_start_ns(), []
    for k in res.events():
        annotation = getattr(k, "is_user_annotation", lambda: False)()  # a range's GPU-track copy
        if k.device_type() == DeviceType.CUDA and not annotation:
            start = (k.start_ns() - t0) / 1e3
            op = ops.get(k.linked_correlation_id())
            chain = launch_chain(op) if op is not None else "?"
            if frames is not None and op is not None:
                chain += " @ " + (frames(op) or "no Python frame")
            phase = launch_phase(op) if op is not None else "?"
            out.append((start, start + k.duration_ns() / 1e3, k.name(), chain, phase))
    return out


FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")  # "path.py(12): func"


def launch_chain(e, depth: int = 6) -> str:
    """A host event and its enclosing ops, innermost first ("aten::mm < aten::linear < ...")."""
    chain = []
    while e is not None and len(chain) < depth:
        if not (FRAME.match(e.name) or e.name.startswith("<built-in")):  # Python calls: stacks
            chain.append(e.name)
        e = e.cpu_parent
    return " < ".join(chain)


PHASE_PREFIX = "engine."  # the engine's record_function ranges (micro_batches, forward, ...)


def launch_phase(e) -> str:
    """The innermost engine range (`engine.*`) around a host event; "backward" for ops autograd's
    thread ran; "host" for a stage's work outside the engine's ranges; "?" outside any stage."""
    while e is not None:
        if e.name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if e.name.startswith(PHASE_PREFIX):
            return e.name
        if e.name.startswith(STAGE_PREFIX):
            return "host"
        e = e.cpu_parent
    return "?"


def device_gaps(kernels: list, start: float) -> tuple[float, list]:
    """The union of `kernels` [(start, end, ...)] from `start` on: (busy us, its gaps [(gap start,
    gap end, the rest of the kernel that ends the gap)])."""
    busy, gaps, t = 0.0, [], start  # t: the end of the device's work so far
    for a, b, *rest in sorted(kernels):
        if b <= t:
            continue
        if a > t:
            gaps.append((t, a, *rest))
        busy += b - max(a, t)
        t = b
    return busy, gaps


def idle_by_launcher(kernels: list, *, min_gap_us: float = 10.0, top: int = 15) -> dict:
    """The device's idle gaps of at least `min_gap_us` between its first and last kernel, each
    charged to the host chain that launched the kernel ending it (what the GPU waited for):
    `kernels` [(start, end, chain)] -> {"idle_us", "gaps", "by_launcher": {chain: us} (top),
    ...}."""
    by, count = Counter(), Counter()
    first = min((k[0] for k in kernels), default=0.0)
    gaps = [g for g in device_gaps(kernels, first)[1] if g[1] - g[0] >= min_gap_us]
    for a, b, chain in gaps:
        by[chain] += b - a
        count[chain] += 1
    return {"idle_us": float(sum(b - a for a, b, _ in gaps)), "gaps": len(gaps),
            "by_launcher": {c: {"us": us, "gaps": count[c]} for c, us in by.most_common(top)}}


def _summarise(stages, kernels, *, top: int, host: list = ()) -> dict:
    """stages [(name, start, end)], kernels [(start, end, name[, launcher[, phase]])], host waits
    [(start, end, where)], in us."""
    out: dict = {}
    for name, start, end in stages:
        s = out.setdefault(name, {"wall_s": 0.0, "kernel_s": 0.0, "kernels": 0, "idle_s": 0.0,
                                  "_by": defaultdict(lambda: [0.0, 0]), "_waits": Counter(),
                                  "_gaps": Counter(), "_phases": Counter(),
                                  "_host": defaultdict(lambda: [0.0, 0])})
        s["wall_s"] += (end - start) / 1e6
        for a, b, where in host:
            if start <= a and b <= end:
                s["_host"][where][0] += (b - a) / 1e6
                s["_host"][where][1] += 1
        inside = [k for k in kernels if start <= k[0] and k[1] <= end]
        for k0, k1, kname, *_ in inside:
            s["kernel_s"] += (k1 - k0) / 1e6
            s["kernels"] += 1
            s["_by"][kname][0] += (k1 - k0) / 1e6
            s["_by"][kname][1] += 1
        _, gaps = device_gaps([(a, b, *(list(rest) + ["?", "?"])[:2])
                               for a, b, _, *rest in inside], start)
        gaps.append((max([start] + [k[1] for k in inside]), end, "(stage end)", "(stage end)"))
        for a, b, who, phase in gaps:
            if b > a:
                s["idle_s"] += (b - a) / 1e6
                s["_waits"][who] += (b - a) / 1e6
                s["_gaps"][who] += 1
                s["_phases"][phase] += (b - a) / 1e6
    for s in out.values():
        by, waits, gaps = s.pop("_by"), s.pop("_waits"), s.pop("_gaps")
        s["idle_by_phase"] = dict(s.pop("_phases").most_common())
        s["top"] = [{"kernel": k[:120], "s": v[0], "calls": v[1]}
                    for k, v in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]]
        s["waits"] = [{"launcher": w[:200], "s": v, "gaps": gaps[w]}
                      for w, v in waits.most_common(top)]
        s["host_waits"] = [{"where": w[:300], "s": v[0], "count": v[1]} for w, v in
                           sorted(s.pop("_host").items(), key=lambda kv: -kv[1][0])[:top]]
    return out


def _on_device(e) -> bool:
    return e.device_type != torch.autograd.DeviceType.CPU


def _is_kernel(e) -> bool:
    """A device kernel, memcpy or memset; not a GPU-track copy of a record_function range (the
    stages', the optimizer's)."""
    return _on_device(e) and not getattr(e, "is_user_annotation", False)


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _gzipped_trace(prof, path: str) -> None:
    plain = path + ".json"
    try:
        prof.export_chrome_trace(plain)
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    finally:
        if os.path.exists(plain):
            os.remove(plain)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hybridflow.profiling",
                                 description="per-stage kernel summary of a saved step trace")
    ap.add_argument("trace", help="a step<N>_rank<R>.trace.json.gz (or plain .json)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        summary = trace_summary(json.load(f), top=args.top)
    for name, st in summary.items():
        busy = st["kernel_s"] / st["wall_s"] if st["wall_s"] else 0.0
        print(f"{name:14s} wall {st['wall_s'] * 1e3:9.2f} ms  kernels {st['kernel_s'] * 1e3:9.2f} ms "
              f"({100 * busy:3.0f}% busy, {st['kernels']} launches), idle "
              f"{st['idle_s'] * 1e3:.2f} ms")
        for k in st["top"]:
            print(f"    {k['s'] * 1e3:8.2f} ms {k['calls']:6d}x  {k['kernel'][:90]}")
        for w in st["waits"][:6]:
            print(f"    idle {w['s'] * 1e3:8.2f} ms {w['gaps']:6d} gaps before  "
                  f"{w['launcher'][:80]}")
        for w in st.get("host_waits", [])[:6]:
            print(f"    host waited {w['s'] * 1e3:8.2f} ms {w['count']:4d}x  {w['where'][:80]}")
        phases = {k: v for k, v in st["idle_by_phase"].items() if k != "?"}
        if len(phases) > 1 or "(stage end)" not in phases:  # a saved trace names no ranges
            print("    idle by phase: " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                                 for k, v in phases.items()))


if __name__ == "__main__":
    main()
