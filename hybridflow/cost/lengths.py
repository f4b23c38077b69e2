"""Response lengths as a distribution: what the variable-length terms read (`Workload.response_lengths`).

A distribution is a sorted tuple of K representative lengths, each standing for 1/K of the rows (the
quantiles at (k + 0.5) / K); `row_lengths` spreads it over a step's N rows. It comes from:
- observed lengths (`quantile_points`: a probe's or a previous run's per-row lengths);
- a few quantiles ({0.5: 187, 0.9: 712, 1.0: 1024}: `from_quantiles`, linear between them);
- the trainer's per-step statistics (response_length/mean, /max, /min, /clip_ratio in metrics.jsonl:
  `fit_stats`): L = min(cap, min + X) with X log-normal, its upper tail pinned by the share of rows
  at the cap (or, when none reached it, by the longest row as the 1 - 1/(2N) quantile) and its
  spread solved so that the capped mean is the measured mean. One shape for every run: on the
  GSM8K recipe it leaves ~16 of 512 rows running to token ~750 where the runs' rows but the ~6
  capped ones end by ~530 (benchmarks/gen_tail_diagnosis.py);
- the trainer's rollout_lengths.jsonl beside its metrics.jsonl (every trained response's length,
  per step): the steps' lengths pooled, as observed lengths.
`load_lengths` reads any of these from a file (metrics.jsonl, which takes the lengths from the
rollout_lengths.jsonl beside it when there is one; rollout_lengths.jsonl itself; a probe.json; or a
JSON of lengths or quantiles) as `Workload` keyword arguments.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from statistics import NormalDist

POINTS = 256          # representative lengths kept per distribution
_GRID = 4000          # quantile grid of the log-normal fit's capped mean


def quantile_points(values, k: int = POINTS) -> tuple[int, ...]:
    """K representative lengths of an observed sample: its quantiles at (i + 0.5) / K."""
    xs = sorted(int(v) for v in values)
    if not xs:
        raise ValueError("lengths: an empty sample")
    if any(v < 1 for v in xs):
        raise ValueError(f"lengths: every length must be >= 1, got {xs[0]}")
    k = min(k, len(xs))
    return tuple(xs[min(len(xs) - 1, int((i + 0.5) * len(xs) / k))] for i in range(k))


def from_quantiles(quantiles: dict, k: int = POINTS) -> tuple[int, ...]:
    """K lengths from {q: length} (q in [0, 1]; 0 and 1 default to the nearest given value),
    linear in between."""
    pts = sorted((float(q), float(v)) for q, v in quantiles.items())
    if not pts or any(not 0 <= q <= 1 for q, _ in pts):
        raise ValueError(f"response length quantiles: expected {{q in [0, 1]: length}}, got {quantiles}")
    if any(b[1] < a[1] for a, b in zip(pts, pts[1:])):
        raise ValueError(f"response length quantiles must not decrease: {quantiles}")
    head = [(0.0, pts[0][1])] if pts[0][0] > 0 else []
    pts = head + pts + ([(1.0, pts[-1][1])] if pts[-1][0] < 1 else [])

    def at(u):
        for (q0, v0), (q1, v1) in zip(pts, pts[1:]):
            if u <= q1:
                return v0 if q1 == q0 else v0 + (v1 - v0) * (u - q0) / (q1 - q0)
        return pts[-1][1]
    return tuple(max(1, round(at((i + 0.5) / k))) for i in range(k))


def fit_stats(*, mean: float, cap: int, clip_ratio: float = 0.0, longest: float | None = None,
              shortest: float = 1.0, rows: int = 512, k: int = POINTS) -> tuple[int, ...]:
    """K lengths of min(cap, shortest + X), X log-normal, with the given capped mean and share at
    the cap (`clip_ratio`; 0: the longest row is the 1 - 1/(2 rows) quantile instead)."""
    if not 1 <= shortest <= mean <= cap:
        raise ValueError(f"response lengths: need 1 <= min ({shortest}) <= mean ({mean}) <= cap ({cap})")
    if not 0 <= clip_ratio < 1:
        raise ValueError(f"response_length/clip_ratio must be in [0, 1), got {clip_ratio}")
    a = max(0.0, float(shortest) - 1.0)
    if clip_ratio > 0:
        anchor, z_anchor = cap - a, NormalDist().inv_cdf(1 - clip_ratio)
    else:
        top = min(float(longest if longest is not None else cap), cap)
        anchor, z_anchor = max(top - a, 1.0), NormalDist().inv_cdf(1 - 0.5 / max(rows, 1))
    zs = [NormalDist().inv_cdf((i + 0.5) / _GRID) for i in range(_GRID)]

    def lengths(sigma, z):
        return [min(cap, a + math.exp(math.log(anchor) + sigma * (zi - z_anchor))) for zi in z]

    lo, hi = 1e-3, 6.0          # the capped mean falls as sigma grows (the tail is pinned)
    for _ in range(60):
        mid = (lo + hi) / 2
        if statistics.fmean(lengths(mid, zs)) > mean:
            lo = mid
        else:
            hi = mid
    sigma = (lo + hi) / 2
    z_k = [NormalDist().inv_cdf((i + 0.5) / k) for i in range(k)]
    return tuple(max(1, min(cap, round(v))) for v in lengths(sigma, z_k))


def _median(rows: list[dict], key: str):
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def from_metrics(rows: list[dict], *, cap: int, num_rows: int = 512) -> dict:
    """Workload lengths from the trainer's per-step metrics (medians over the steps; the longest
    prompt and response over all of them). With
    dynamic sampling also gen_rounds / gen_prompt_factor (the means of dynamic_sampling/rounds and
    /batches); where the speculative tail ran, spec_tail_tokens_per_step (the median of
    rollout/spec_tokens_per_row_step, for that run's draft count)."""
    steps = [r for r in rows if "response_length/mean" in r]
    if not steps:
        raise ValueError("lengths: no step with response_length/mean (a trainer metrics.jsonl "
                         "expected)")
    mean = _median(steps, "response_length/mean")
    longest = max(float(r.get("response_length/max", mean)) for r in steps)
    out = {"response_lengths": fit_stats(
        mean=mean, cap=cap, clip_ratio=_median(steps, "response_length/clip_ratio") or 0.0,
        longest=longest, shortest=max(1.0, min(_median(steps, "response_length/min") or 1.0, mean)),
        rows=num_rows)}
    rounds = [float(r["dynamic_sampling/rounds"]) for r in steps if "dynamic_sampling/rounds" in r]
    batches = [float(r["dynamic_sampling/batches"]) for r in steps if "dynamic_sampling/batches" in r]
    if rounds and batches:   # dynamic sampling: the mean generation calls and prompt batches
        out["gen_rounds"] = max(1.0, statistics.fmean(rounds))
        out["gen_prompt_factor"] = max(1.0, statistics.fmean(batches))
    tail = [r for r in steps if float(r.get("rollout/spec_row_steps", 0)) > 0]
    if tail:  # the speculative tail ran: what a running row gained per tail step (its drafts')
        out["spec_tail_tokens_per_step"] = max(
            1.0, _median(tail, "rollout/spec_tokens_per_row_step"))
    p_mean = _median(steps, "prompt_length/mean")
    if p_mean is not None:
        out["prompt_len"] = max(1, round(p_mean))
        p_max = max(float(r.get("prompt_length/max", p_mean)) for r in steps)
        out["prompt_len_max"] = max(out["prompt_len"], round(p_max))
    return out


def load_lengths(path: str | Path, *, cap: int, num_rows: int = 512) -> dict:
    """`Workload` keyword arguments (response_lengths, and prompt_len / prompt_len_max where the
    file has them) from: a trainer metrics.jsonl or rollout_lengths.jsonl (`_from_run`); a
    probe.json (its "lengths"); or a JSON object with "response_lengths" (observed lengths),
    "response_length_quantiles" ({q: length}) or the statistics {"mean", "max", "min",
    "clip_ratio"}, optionally "prompt_len" and "prompt_len_max"."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"lengths file {path} not found")
    if path.suffix == ".jsonl":
        out = _from_run(_read(path), path, cap=cap, num_rows=num_rows)
    else:
        out = _from_json(_read(path), path, cap=cap, num_rows=num_rows)
    if max(out["response_lengths"]) > cap:
        raise ValueError(f"{path}: a response of {max(out['response_lengths'])} tokens is longer "
                         f"than the cap of {cap} (--response-len-max / rollout.max_new_tokens)")
    return out


def _read(path: Path):
    """A .jsonl file's objects, or a JSON file's value; invalid JSON is an error naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                return [json.loads(x) for x in f if x.strip()]
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}: line {e.lineno})") from None


def _from_json(data, path: Path, *, cap: int, num_rows: int) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    data = data.get("lengths", data)           # probe.json keeps them under "lengths"
    out = {k: int(data[k]) for k in ("prompt_len", "prompt_len_max") if k in data}
    if "response_lengths" in data:
        out["response_lengths"] = quantile_points(data["response_lengths"])
    elif "response_length_quantiles" in data:
        out["response_lengths"] = from_quantiles(data["response_length_quantiles"])
    elif "mean" in data:
        out["response_lengths"] = fit_stats(
            mean=float(data["mean"]), cap=cap, clip_ratio=float(data.get("clip_ratio", 0.0)),
            longest=data.get("max"), shortest=float(data.get("min", 1.0)), rows=num_rows)
    else:
        raise ValueError(f"{path}: expected response_lengths, response_length_quantiles or "
                         f"mean/max/min/clip_ratio (or a metrics.jsonl)")
    return out


def _pooled(rows: list[dict], path: Path) -> tuple[int, ...]:
    lengths = [n for r in rows for n in r.get("response_lengths", ())]
    if not lengths:
        raise ValueError(f"{path}: no step with response_lengths")
    return quantile_points(lengths)


def run_file(path: str | Path, name: str) -> Path:
    """The file `name` (metrics.jsonl, rollout_lengths.jsonl) of the run whose metrics or lengths
    file `path` is: the one beside it, with the same prefix where a run's files were committed
    under one (`dapo_metrics.jsonl` beside `dapo_rollout_lengths.jsonl`)."""
    from hybridflow.metrics import MetricsLogger

    path = Path(path)
    for own in (MetricsLogger.METRICS_FILE, MetricsLogger.LENGTHS_FILE):
        if path.name.endswith(own):
            return path.with_name(path.name[:-len(own)] + name)
    return path.with_name(name)


def _from_run(rows: list[dict], path: Path, *, cap: int, num_rows: int) -> dict:
    """A trainer run's files: metrics.jsonl (its statistics; the exact lengths from the
    rollout_lengths.jsonl beside it, when there is one) or rollout_lengths.jsonl (its lengths; the
    rest from the metrics.jsonl beside it, when there is one); `run_file` pairs them."""
    from hybridflow.metrics import MetricsLogger

    if any("response_lengths" in r for r in rows):   # rollout_lengths.jsonl
        metrics = run_file(path, MetricsLogger.METRICS_FILE)
        out = from_metrics(_read(metrics), cap=cap, num_rows=num_rows) if metrics.is_file() \
            else {}
        out["response_lengths"] = _pooled(rows, path)
        return out
    out = from_metrics(rows, cap=cap, num_rows=num_rows)
    beside = run_file(path, MetricsLogger.LENGTHS_FILE)
    if beside.is_file():
        out["response_lengths"] = _pooled(_read(beside), beside)
    return out
