"""Where the multi-turn decode step's device time goes (profile_decode.py --multi-turn).

The step is the product's: `multi_turn_step.DecodeState` + `decode_step` on a Generator with
random-init weights of the model shape (bf16; profile_decode's transformers model converted to
Megatron names), `rows` rows all fed each step (every row decoding; ctrl READY = 1), attending
over `columns` cache columns (the step's kv_len: a decode_kv_window of that width, or the whole
cache when it is the widest), rollout temperature --temperature (1: a temperature draw and the
log-probs of every token, as the GSM8K tool job runs), per --kernels value (rollout.decode_kernels:
"triton" runs the single-turn step's fused layers, decoder.decode_step with a column per row;
"torch" `extend` of one token; with --fused-sampler on the draw and its log-prob are
kernels/sample.py's under "triton"). Per model x kernels x rows x columns, two cases:
- graphed: decode_step(graphed=True), one CUDA-graph replay per step (rollout.cuda_graphs);
- eager: the same function run as PyTorch ops (rollout.cuda_graphs=false).
Each: kernel time per step (profiled runs of --steps and 2 x --steps steps, their difference over
--steps, as profile_decode's single-turn cases), kernels per step, wall us per step (back-to-back
steps, and `wall_us_per_step_host_io`: each step also copying the host's control row in and the
drawn tokens / log-probs out, as multi_turn._launch and _read do), the weight + KV read floor.

Kinds (MT_KINDS): the eager profile runs under a TorchFunctionMode that wraps every torch call
in a record_function naming its innermost hybridflow source line, so each kernel is attributed
by the line (and function) that launched it: sampling (sampling.sample), logprobs
(sampling._token_logprobs), gemm (mm/addmm/linear), attention (the SDPA call, any copies SDPA
makes of its mask included), mask (extend's mask/bias building and key_valid bookkeeping), rope
(cos/sin gathers and the rotation), kv_write (the cache writes), norm, elementwise (the rest of
the layers and the logits copy), other (embedding, the step's own bookkeeping); a kernel no
tagged torch call launched (the fused path's Triton kernels) takes profile_decode's name rules
(`where` "(Triton launch)"). Kernel names
are the same in a replayed graph, so a graphed kernel's time goes to the kinds its name had in
the eager profile (split by their eager time where one name served several); names the eager
run never launched fall back to profile_decode's name rules. `lines`: the eager step's kernel
time per source line (top 25), the culprit's address.

`pieces` (median of --reps after a warm call; CUDA events on a GPU) on the same shapes, each
called alone eagerly and (GPU, `graphed`) captured alone and replayed: sample(...),
_token_logprobs(...), both as kernels/sample.sample_rows (at a temperature > 0), one extend of
S=1 over the rows and columns (the torch step's call), the LM head (decoder.logits) and the
copy of its logits into the state, and the bare SDPA of one layer (a query of the step's shape
against the cache's views) with the step's mask form (an additive bias of shape (r, 1, 1, L)), a
boolean mask of that shape and no mask; `sdpa_one_layer_forced`:
each mask form under each forced backend (flash, efficient, cudnn, math; the error where one
refuses it).

    python benchmarks/profile_decode.py --multi-turn \\
        --models hybridflow/conf/model/qwen2_5_coder_0_5b.yaml --batches 128 512 \\
        --columns 576 1024 --steps 8 --kernels torch triton \\
        --out benchmarks/results/multi_turn_profile_h200.json
        # one H200: a few minutes (most of it the host parsing the tagged eager profiles)
    python benchmarks/profile_decode.py --multi-turn --models hybridflow/conf/model/tiny.yaml \\
        --device cpu --batches 2 --columns 64 --steps 4 --reps 2 --out /tmp/mt.json  # CPU smoke
"""

from __future__ import annotations

import collections
import functools
import linecache
import os
import statistics
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

import hybridflow
from hybridflow.config import RolloutConfig
from hybridflow.kernels.sample import new_rng_state, sample_rows
from hybridflow.rollout import decoder
from hybridflow.rollout.multi_turn_step import DecodeState, decode_step, extend
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.sampling import _token_logprobs, sample

MT_KINDS = ("gemm", "attention", "mask", "kv_write", "rope", "norm", "sampling", "logprobs",
            "elementwise", "other")
TAG = "@"  # record_function names of the source-line tags start with it
_PKG = os.path.dirname(os.path.abspath(hybridflow.__file__)) + os.sep  # tagged frames: its files
_ROOT = os.path.dirname(os.path.dirname(_PKG))  # tags name files relative to it
_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
             "aten::_scaled_mm")  # and their in-place forms (addmm_)


def _gemm(ops: tuple) -> bool:
    return any(o.startswith(_GEMM_OPS) for o in ops)


@functools.cache
def _rel(path: str) -> str:
    return os.path.relpath(path, _ROOT)


class LineTags(TorchFunctionMode):
    """Every torch call inside runs under record_function("@file:line func"), the innermost
    hybridflow frame that made it (calls made inside a call are not tagged again: the mode is
    off while its handler runs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None and not f.f_code.co_filename.startswith(_PKG):
            f = f.f_back
        tag = (f"{TAG}{_rel(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"
               if f is not None else f"{TAG}?")
        with torch.profiler.record_function(tag):
            return func(*args, **(kwargs or {}))


def line_kind(tag: str, ops: tuple) -> tuple:
    """(kind, where) of an op launched under LineTags `tag` ("@path:line func"), `ops` the aten
    ops enclosing it (innermost first)."""
    if not tag.startswith(TAG) or tag == TAG + "?":
        return ("gemm" if _gemm(ops) else "other"), "?"
    loc, func = tag[len(TAG):].split(" ", 1)
    path, line = loc.rsplit(":", 1)
    text = linecache.getline(os.path.join(_ROOT, path), int(line)).strip()
    where = f"{os.path.basename(path)}:{line} {func}: {text[:70]}"
    if func == "_token_logprobs":
        kind = "logprobs"
    elif func in ("sample", "_race_argmax", "filter_logits"):
        kind = "sampling"
    elif "scaled_dot_product_attention" in text:
        kind = "attention"
    elif _gemm(ops):
        kind = "gemm"
    elif func in ("_norm", "_qk_norm"):
        kind = "norm"
    elif func == "_put" or text.startswith(("kc[", "vc[")):
        kind = "kv_write"
    elif func in ("embed", "step", "decode_step") or "embed(" in text:
        kind = "other"
    elif func == "extend" and ("cos" in text or "sin" in text):
        kind = "rope"
    elif func == "extend" and any(s in text for s in ("mask", "bias", "key_valid", "kv_rows",
                                                       "columns =", "new_valid",
                                                       "t = torch.arange")):
        kind = "mask"
    else:
        kind = "elementwise"
    return kind, where


def _chain(e) -> tuple:
    """(the innermost LineTags tag, the aten ops) enclosing profiler event `e` (itself first)."""
    ops, p = [], e
    while p is not None:
        if p.name.startswith(TAG):
            return p.name, tuple(ops)
        if p.name.startswith("aten::"):
            ops.append(p.name)
        p = p.cpu_parent
    return TAG + "?", tuple(ops)


def profile_tagged(run, device) -> dict:
    """(kernel or, on CPU, aten op name, kind, where) -> (time us, calls) of one run() under
    LineTags (after one untagged, unprofiled call)."""
    from torch.profiler import ProfilerActivity, profile

    from profile_decode import kind_of

    run()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof, LineTags():
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.name.startswith(TAG):  # a tag's own range (its device-side twin too): not a kernel
            continue
        if device.type == "cuda":
            items = [(k.name, k.duration) for k in getattr(e, "kernels", [])
                     if not k.name.startswith(TAG)]
        elif e.name.startswith("aten::"):  # CPU: each aten op's self time
            items = [(e.name, e.self_cpu_time_total)]
        else:
            items = []
        if not items:
            continue
        tag, ops = _chain(e)
        kind, where = line_kind(tag, ops)
        for name, t in items:
            if tag == TAG + "?" and not ops and device.type == "cuda":  # a Triton launch
                kind, where = kind_of(name), "(Triton launch)"
            rec = out[(name, kind, where)]
            rec[0] += t
            rec[1] += 1
    return {k: tuple(v) for k, v in out.items()}


def _summary(per: dict, *, top: int = 15) -> dict:
    """{(name, kind, where): (us, calls)} per step -> by kind, kernels by kind, top names, lines."""
    by_kind, count = collections.Counter(), collections.Counter()
    names, lines = collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()]), \
        collections.defaultdict(lambda: [0.0, 0.0, ""])
    for (name, kind, where), (t, n) in per.items():
        by_kind[kind] += t
        count[kind] += n
        rec = names[name]
        rec[0] += t
        rec[1] += n
        rec[2][kind] += t
        ln = lines[where]
        ln[0] += t
        ln[1] += n
        ln[2] = kind
    order = [k for k in MT_KINDS if k in by_kind]
    return {"us_per_step": sum(by_kind.values()), "kernels_per_step": sum(count.values()),
            "us_per_step_by_kind": {k: by_kind[k] for k in order},
            "kernels_per_step_by_kind": {k: count[k] for k in order},
            "top": [{"kernel": k[:100], "kind": r[2].most_common(1)[0][0], "us_per_step": r[0],
                     "calls_per_step": r[1]}
                    for k, r in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]],
            "lines": [{"line": w, "kind": r[2], "us_per_step": r[0], "calls_per_step": r[1]}
                      for w, r in sorted(lines.items(), key=lambda kv: -kv[1][0])[:25]]}


def by_eager_names(graphed: dict, eager: dict) -> dict:
    """Graphed {name: (us, calls)} -> {(name, kind, where): (us, calls)}: each name's time and
    calls split over the (kind, where) it had in the eager profile `eager`, by eager time (by
    calls where that was 0); a name eager never launched: profile_decode's name rules."""
    from profile_decode import kind_of

    split = collections.defaultdict(dict)
    for (name, kind, where), (t, n) in eager.items():
        split[name][(kind, where)] = (t, n)
    out = {}
    for name, (t, n) in graphed.items():
        parts = split.get(name)
        if not parts:
            out[(name, kind_of(name), "? (not in the eager step)")] = (t, n)
            continue
        total_t = sum(p[0] for p in parts.values())
        total_n = sum(p[1] for p in parts.values())
        for (kind, where), (pt, pn) in parts.items():
            share = pt / total_t if total_t > 0 else pn / total_n
            out[(name, kind, where)] = (t * share, n * share)
    return out


class Case:
    """The product's decode state and step for `rows` rows over `columns` attended columns of
    `gen`'s cache (sized by the caller), graphed or eager; `reset()` puts every row at column
    `columns - 1 - max_steps` with the columns before it valid, all rows fed."""

    def __init__(self, gen, st: DecodeState, rc: RolloutConfig, *, columns: int, graphed: bool,
                 max_steps: int, opts: DecodeOptions = DecodeOptions(kernels="torch")):
        T = gen._cache.length
        self.kv_len = None if columns >= T else columns
        self.c0 = columns - 1 - max_steps
        if self.c0 < 1:
            raise ValueError(f"--columns {columns} must exceed the steps of a profiled run + 2 "
                             f"({max_steps + 2}): lower --steps")
        self.gen, self.st, self.rc, self.columns = gen, st, rc, columns
        self.step = decode_step(gen, st, rc, graphed=graphed, kv_len=self.kv_len, opts=opts)

    def reset(self) -> None:
        st = self.st
        st.key_valid.zero_()
        st.key_valid[:, :self.c0] = True
        st.col.fill_(self.c0)
        st.pos.fill_(self.c0)
        st.ctrl.zero_()
        st.ctrl[DecodeState.READY] = 1

    def run(self, n: int):
        """A function of no arguments: reset, then n steps."""
        def go():
            self.reset()
            for _ in range(n):
                self.step()
        return go


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_us_per_step(case: Case, steps: int, device, *, host_io: bool = False) -> float:
    """Median over 3 runs (after a warm one) of the wall us per step of `steps` steps back to back
    (one sync at the end); `host_io`: each step also copies a host control row in and the step's
    output out (multi_turn._launch and _read: the per-step transfers, its sync included)."""
    import numpy as np

    ctrl = np.zeros(tuple(case.st.ctrl.shape), dtype=np.int64)
    ctrl[DecodeState.READY] = 1
    times = []
    for i in range(4):
        case.reset()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            if host_io:
                case.st.ctrl.copy_(torch.from_numpy(ctrl))
            case.step()
            if host_io:
                case.st.out.cpu().numpy()
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(times)


def profile_mode(case: Case, eager_case: Case, steps: int, device, *, eager_per=None) -> dict:
    """One case's kernel time per step by kind (eager: tagged by line; graphed: by the eager
    profile's names), kernels per step and walls."""
    from profile_decode import per_step, profile_calls

    if eager_per is None:  # the tagged eager profile
        short = profile_tagged(eager_case.run(steps), device)
        long = profile_tagged(eager_case.run(2 * steps), device)
        eager_per = per_step(short, long, steps)
    if case is eager_case:
        per = eager_per
    else:
        short = profile_calls(case.run(steps), device)
        long = profile_calls(case.run(2 * steps), device)
        per = by_eager_names(per_step(short, long, steps), eager_per)
    res = _summary(per)
    res["wall_us_per_step"] = wall_us_per_step(case, steps, device)
    res["wall_us_per_step_host_io"] = wall_us_per_step(case, steps, device, host_io=True)
    return res, eager_per


def timed_us(fn, device, reps: int) -> float:
    """Median us of `reps` calls of fn (CUDA events on a GPU), after one warm call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graphed_us(fn, device, reps: int, *, generator=None) -> float:
    """Median us of `reps` replays of fn captured in a CUDA graph (its kernels without the host's
    launch gaps; `generator` registered with the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    if generator is not None:
        g.register_generator_state(generator)
    with torch.cuda.graph(g):
        fn()
    return timed_us(g.replay, device, reps)


def _guarded(timer, fn, device, reps, **kw):
    try:
        return timer(fn, device, reps, **kw)
    except Exception as e:  # noqa: BLE001 - an unsupported backend / shape: recorded, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def pieces(case: Case, device, reps: int) -> dict:
    """The step's parts called alone on its shapes, median us of `reps`: eager (CUDA events on a
    GPU: an eager call's launch gaps included) and, on a GPU, `graphed` (each part captured alone
    and replayed: its kernels back to back). The SDPA calls ("sdpa/<mask form>") are one layer's,
    as extend makes them; `sdpa_one_layer_forced` "form/backend": each form under each forced
    backend, eager (a string where the backend refuses it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen, st, rc = case.gen, case.st, case.rc
    w, cache, (cos, sin) = gen.w, gen._cache, gen._tables
    d = w.dims
    r, L = st.col.shape[0], case.columns
    inv_temp = 1.0 if rc.temperature == 0.0 else 1.0 / rc.temperature
    rng_state = new_rng_state(0, device)
    case.reset()
    g = torch.Generator(device=device).manual_seed(0)
    tok = torch.randint(0, d.true_vocab, (r,), device=device, generator=g)
    ready = st.ctrl[DecodeState.READY].bool()
    h = torch.randn(r, d.hidden, device=device, generator=g).to(gen.dtype)
    q = torch.randn(r, d.groups, d.heads_per_group, d.head_dim, device=device,
                    generator=g).to(gen.dtype)  # one layer's queries, (r, G, hpg, hd)
    k, v = cache.k[0][:r, :, :L], cache.v[0][:r, :, :L]  # the cache's views, (r, G, L, hd)
    keep = st.key_valid[:r, :L].clone()
    keep[:, L - 1] = True  # the step's own column (its mask's `t == columns` term)
    masks = {"step_bias": torch.zeros((r, 1, 1, L), dtype=gen.dtype, device=device).masked_fill_(
        ~keep[:, None, None, :], float("-inf")),  # the additive (r, 1, 1, L) extend builds
        "bool": keep[:, None, None, :], "none": None}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        lg = decoder.logits(w, h, fp32=False)
        parts = {  # name: (fn, the generator it draws from)
            "sample": (lambda: sample(st.logits, temperature=rc.temperature, top_k=rc.top_k,
                                      top_p=rc.top_p, generator=gen._rng), gen._rng),
            "token_logprobs": (lambda: _token_logprobs(st.logits, tok, inv_temp), None),
            # both of the above as kernels/sample.py's two passes (fused_sampler; T > 0 only)
            **({"sample_rows": (lambda: sample_rows(st.logits, inv_temp, rng_state), None)}
               if rc.temperature > 0 else {}),
            "extend_s1": (lambda: extend(
                w, tok[:, None], st.pos[:, None], ready[:, None], st.col, cache=cache,
                key_valid=st.key_valid, cos_tab=cos, sin_tab=sin, out=st.logits,
                kv_len=case.kv_len), None),
            "lm_head": (lambda: decoder.logits(w, h, fp32=False), None),
            "logits_copy": (lambda: st.logits.copy_(lg), None)}
        for form, mask in masks.items():
            parts[f"sdpa/{form}"] = (lambda mask=mask: sdpa(q, k, v, attn_mask=mask), None)
        res = {name: _guarded(timed_us, fn, device, reps) for name, (fn, _) in parts.items()}
        if device.type == "cuda":
            res["graphed"] = {name: _guarded(graphed_us, fn, device, reps, generator=gen_)
                              for name, (fn, gen_) in parts.items()}
        backends = {"flash": SDPBackend.FLASH_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
        forced = {}
        for form, mask in masks.items():
            for name, be in backends.items():
                def call(mask=mask, be=be):
                    with sdpa_kernel([be]):
                        return sdpa(q, k, v, attn_mask=mask)
                forced[f"{form}/{name}"] = _guarded(timed_us, call, device, reps)
        res["sdpa_one_layer_forced"] = forced
        res["sdpa_layers"] = d.num_layers
    case.reset()
    return res


def run(args, report: dict, *, cfg, gen, weight_bytes: int, device) -> None:
    """profile_decode --multi-turn: the cases of one model into report["multi_turn"] (the JSON
    written after each case by the caller's `write`)."""
    from bench_generate import COPY_BW
    from profile_decode import write_json

    d = gen.w.dims
    rc = RolloutConfig(temperature=args.temperature, return_logprobs=True,
                       max_batch_size=max(args.batches))
    LM = 64  # generator.LENGTH_MULTIPLE
    T = -(-max(args.columns) // LM) * LM
    gen._ensure_cache(rows=max(args.batches), length=T)
    max_steps = 2 * args.steps + 1
    out = report.setdefault("multi_turn", [])
    fused_sampler = getattr(args, "fused_sampler", None) == "on"  # profile_decode's flag
    kinds = [DecodeOptions(kernels=k, fused_sampler=fused_sampler).resolved(device, d.head_dim)
             for k in getattr(args, "kernels", None) or ["torch"]]
    with torch.no_grad():
        for B in args.batches:
            st = DecodeState(B, gen._cache.length, d.true_vocab, device, gen.dtype)
            st.logits.normal_()
            for L in args.columns:
                kv_bytes = 2 * d.num_layers * B * d.groups * d.head_dim * L * gen.dtype.itemsize
                floor_us = (weight_bytes + kv_bytes) / COPY_BW * 1e6
                common = dict(model=cfg.name, batch=B, columns=L, floor_us_per_step=floor_us,
                              kv_bytes=kv_bytes, weight_bytes=weight_bytes,
                              logits_bytes=B * d.true_vocab * gen.dtype.itemsize)
                for opts in kinds:
                    eager = Case(gen, st, rc, columns=L, graphed=False, max_steps=max_steps,
                                 opts=opts)
                    graphed = Case(gen, st, rc, columns=L, graphed=True, max_steps=max_steps,
                                   opts=opts)
                    eager_per = None
                    for mode, case in (("eager", eager), ("graphed", graphed)):
                        try:
                            res, eager_per = profile_mode(case, eager, args.steps, device,
                                                          eager_per=eager_per)
                        except Exception as e:  # noqa: BLE001 - keep the other cases' numbers
                            res = {"error": f"{type(e).__name__}: {e}"[:400]}
                        res.update(mode=mode, kernels=opts.kernels,
                                   fused_sampler=opts.fused_sampler, **common)
                        if mode == "graphed" and res.get("kernels_per_step") == 0:
                            res["note"] = ("the profiler saw no kernels in the graph replays "
                                           "(CUPTI without graph tracing): the eager case's "
                                           "kinds stand")
                        if "us_per_step" in res:  # of the kernel time (as profile_decode), wall
                            res["floor_fraction"] = floor_us / max(res["us_per_step"], 1e-9)
                            res["floor_fraction_wall"] = floor_us / res["wall_us_per_step"]
                        out.append(res)
                        write_json(args.out, report)
                        _print(res)
                    if opts.kernels == "torch":  # the pieces are the torch step's (extend's)
                        try:
                            pc = pieces(eager, device, args.reps)
                        except Exception as e:  # noqa: BLE001
                            pc = {"error": f"{type(e).__name__}: {e}"[:400]}
                        report.setdefault("multi_turn_pieces", []).append(dict(pieces=pc,
                                                                               **common))
                        write_json(args.out, report)
                        _print_pieces(pc)
                    del eager, graphed
            del st


def _print(res: dict) -> None:
    head = (f"{res['model']} rows={res['batch']} columns={res['columns']} {res['kernels']} "
            f"{res['mode']}")
    if "error" in res:
        print(f"{head}: {res['error']}", flush=True)
        return
    print(f"{head}: {res['us_per_step']:.0f} us/step kernels ({res['wall_us_per_step']:.0f} "
          f"wall, {res['wall_us_per_step_host_io']:.0f} with host io), "
          f"{res['kernels_per_step']:.0f} kernels, floor {res['floor_us_per_step']:.0f} us  " +
          ", ".join(f"{k} {v:.0f}" for k, v in res["us_per_step_by_kind"].items()), flush=True)
    for ln in res["lines"][:8]:
        print(f"    {ln['us_per_step']:8.1f} us {ln['calls_per_step']:5.1f}x {ln['kind']:11s} "
              f"{ln['line']}", flush=True)


def _print_pieces(pc: dict) -> None:
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)[:60]  # noqa: E731
    for title, part in (("pieces eager", pc), ("pieces graphed", pc.get("graphed") or {}),
                        ("sdpa forced backends", pc.get("sdpa_one_layer_forced") or {})):
        items = [(k, v) for k, v in part.items() if isinstance(v, (float, str))]
        if items:
            print(f"  {title} (us): " + ", ".join(f"{k} {fmt(v)}" for k, v in items), flush=True)
