"""Can a reference pass run beside generation's tail without slowing it? A probe of SM sharing.

The GSM8K step's last few hundred decode steps run a handful of rows: each step is a chain of small,
latency-bound kernels that leave most SMs idle. Running the reference pass over the rows already
finished in that time lost on an H100 (generation +0.40 s for 0.30 s of the pass hidden; the pass's
large GEMM blocks held the SMs the decode kernels waited for). This measures the two kinds of work
side by side, without the trainer:
- `decode`: one CUDA graph of a decode step's GEMMs at the tail's row count (`--model`'s shapes,
  Qwen2.5-Coder-0.5B by default: QKV, projection, fc1, SwiGLU, fc2 and two RMSNorms per layer),
  replayed `--steps` times, each step synchronised with the host as the tail's drafts are (one
  read per step);
- `pass`: the same layers over a packed micro-batch of `--pass-tokens` tokens, launched from a
  thread of its own (as a background pass would be), for as long as decoding runs.
Modes: `alone` (decoding by itself), `shared` (both on ordinary streams), `priority` (decode on a
high-priority stream, the pass on a low one), `green<N>` (the pass on a CUDA green context of N SMs,
decode on the primary context). Reported per mode: decode ms per step, the pass's rate against its
rate alone, and what the overlap is worth (`overlap_value`): the share of the pass's time it hides
net of decoding's slowdown, and how many tail steps one second of pass work needs.

  python benchmarks/probe_tail_overlap.py --rows 16 64 \\
      --modes alone shared priority green64 green96 green112 green120 \\
      --out benchmarks/results/tail_overlap_h100.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402

SWITCH_INTERVAL_S = 2e-4  # the interpreter's thread switch interval while both threads launch


def weights(model: str, device) -> list:
    """Random bf16 weights of `model`'s layers (cost.shapes): (qkv, proj, fc1, fc2, norm) each."""
    from hybridflow.cost.shapes import load_shape

    c = load_shape(model)
    h, q = c.hidden_size, c.num_attention_heads * c.kv_channels
    qkv = q + 2 * c.num_query_groups * c.kv_channels
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(o, i):
        return (torch.randn(o, i, generator=g) / i ** 0.5).to(device, torch.bfloat16)

    return [(w(qkv, h), w(h, q), w(2 * c.ffn_hidden_size, h), w(h, c.ffn_hidden_size),
             torch.ones(h, device=device, dtype=torch.bfloat16)) for _ in range(c.num_layers)]


def hidden(ws) -> int:
    return ws[0][4].numel()


def layers(x: torch.Tensor, ws: list) -> torch.Tensor:
    for qkv, proj, fc1, fc2, norm in ws:
        h = F.rms_norm(x, norm.shape, norm)
        x = x + F.linear(F.linear(h, qkv)[:, :proj.shape[1]], proj)
        h = F.linear(F.rms_norm(x, norm.shape, norm), fc1)
        g, u = h.chunk(2, dim=-1)
        x = x + F.linear(F.silu(g) * u, fc2)
    return x


def enter(green):  # the green context current for this thread (the name differs across torch)
    (getattr(green, "make_current", None) or green.set_context)()


def leave(green):
    (getattr(green, "pop_current", None) or green.pop_context)()


class Pass:
    """The background pass: `layers` over (tokens, hidden) again and again from a thread of its
    own, on `stream` (or on a green context's stream), until stopped; counts its passes."""

    def __init__(self, ws, tokens: int, device, stream=None, green=None):
        self.ws, self.device, self.stream, self.green = ws, device, stream, green
        self.x = torch.randn(tokens, hidden(ws), device=device, dtype=torch.bfloat16)
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        torch.cuda.set_device(self.device)
        with torch.no_grad(), torch.cuda.stream(self.stream or torch.cuda.Stream(self.device)):
            if self.green is not None:
                enter(self.green)
            try:
                while not self._stop.is_set():
                    layers(self.x, self.ws)
                    torch.cuda.current_stream().synchronize()  # counted once it ran
                    self.done += 1
            finally:
                if self.green is not None:
                    leave(self.green)

    def __enter__(self):
        self._thread.start()
        time.sleep(0.05)  # its first pass under way
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def decode_graph(ws, rows: int, device, stream):
    x = torch.randn(rows, hidden(ws), device=device, dtype=torch.bfloat16)
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            layers(x, ws)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layers(x, ws)
    return graph


def decode_steps(graph, stream, steps: int) -> list:
    """ms per step: replay, then one host read (the tail's drafts), as the tail steps do."""
    flag = torch.zeros(1, device=stream.device, dtype=torch.int32)
    out = []
    with torch.cuda.stream(stream):
        for _ in range(steps):
            t0 = time.perf_counter()
            graph.replay()
            flag.item()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def pass_rate(ws, tokens: int, device, seconds: float = 1.0) -> float:
    """Background passes per second with the GPU to itself."""
    x = torch.randn(tokens, hidden(ws), device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            layers(x, ws)
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            layers(x, ws)
            torch.cuda.synchronize()
            n += 1
    return n / (time.perf_counter() - t0)


def overlap_value(base_ms: float, decode_ms: float, share: float) -> dict:
    """What running the pass beside decoding is worth. Per decode step the pass does
    `share * decode_ms` of its solo time and the step takes `decode_ms - base_ms` longer, so of
    the pass's time a share `hidden_share` is hidden net of decoding's slowdown (negative: the
    overlap loses), and one second of solo pass work takes `steps_per_pass_s` decode steps (the
    tail must have that many for the whole pass to fit under it)."""
    done = share * decode_ms
    return {"hidden_share": 1.0 - (decode_ms - base_ms) / done, "steps_per_pass_s": 1e3 / done}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2_5_coder_0_5b", help="a shape of cost.shapes")
    ap.add_argument("--rows", type=int, nargs="+", default=[16], help="decode rows (the tail's)")
    ap.add_argument("--steps", type=int, default=400, help="decode steps timed per mode")
    ap.add_argument("--pass-tokens", type=int, default=40960, help="the pass's micro-batch tokens")
    ap.add_argument("--modes", nargs="+",
                    default=["alone", "shared", "priority", "green64", "green96", "green112"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if "alone" not in a.modes:
        ap.error("--modes must include alone (the other modes are measured against it)")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ws = weights(a.model, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    lo, hi = torch.cuda.Stream.priority_range()  # (lowest, highest)
    rate_alone = pass_rate(ws, a.pass_tokens, device)
    res = {"model": a.model, "sms": sms, "pass_tokens": a.pass_tokens,
           "pass_ms_alone": 1e3 / rate_alone, "rows": {}}
    print(f"{sms} SMs; pass of {a.pass_tokens} tokens alone {1e3 / rate_alone:.2f} ms", flush=True)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        for rows in a.rows:
            out = res["rows"][str(rows)] = {}
            for mode in ["alone"] + [m for m in a.modes if m != "alone"]:
                dec_stream = torch.cuda.Stream(device, priority=hi if mode == "priority" else 0)
                graph = decode_graph(ws, rows, device, dec_stream)
                decode_steps(graph, dec_stream, 20)  # warm
                green, bg_stream = None, None
                if mode.startswith("green"):
                    from torch.cuda.green_contexts import GreenContext

                    try:
                        green = GreenContext.create(int(mode[5:]), device.index)
                    except Exception as e:  # noqa: BLE001 - recorded, the other modes go on
                        out[mode] = {"error": f"{type(e).__name__}: {e}"}
                        print(rows, mode, out[mode], flush=True)
                        continue
                elif mode == "priority":
                    bg_stream = torch.cuda.Stream(device, priority=lo)
                if mode == "alone":
                    t, share = decode_steps(graph, dec_stream, a.steps), 0.0
                else:
                    with Pass(ws, a.pass_tokens, device, stream=bg_stream, green=green) as p:
                        start = p.done
                        t = decode_steps(graph, dec_stream, a.steps)
                        share = (p.done - start) / (sum(t) / 1e3 * rate_alone)
                r = out[mode] = {"decode_ms_median": statistics.median(t),
                                 "decode_ms_mean": statistics.fmean(t),
                                 "pass_share_of_alone": share}
                if mode != "alone" and share > 0:
                    base = out["alone"]["decode_ms_mean"]
                    r.update(overlap_value(base, r["decode_ms_mean"], share))
                print(rows, mode, {k: round(v, 3) for k, v in r.items()}, flush=True)
    finally:
        sys.setswitchinterval(switch)
    write_json(a.out, {"benchmark": "decode tail beside a background pass (SM sharing probe)",
                       "machine": machine(), "versions": versions(), "command": command(), **res})
    print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
