"""Probe runs: `trainer.probe_steps=N` runs N steps of the real config, then writes
`<output_dir>/probe.json` and prints what the full run will take.

Measured: peak memory per GPU, seconds per stage (median over the probe steps after the first, which
pays for CUDA-graph capture and allocator warm-up), the reward trend. Extrapolated: the full run's
time (total_steps x median step), GPU-hours and money (`trainer.price_per_gpu_hour`, or the cost
model's default for this GPU). Beside the measurement: the cost model's prediction for the same
config and layout (hybridflow.cost) at the lengths the probe steps had (mean and longest prompt,
the response lengths as a distribution fitted to their statistics), when the GPU is in its table
(on CPU there is no prediction), and what the estimator would change at those lengths
(rollout.quantization, rollout.partial: "consider"). probe.json's "lengths" are those statistics:
`python -m hybridflow.cost --config ... --lengths probe.json` predicts other configs at them.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist



def gpu_name() -> str | None:
    """The cost model's name of this process's GPU (hybridflow.cost.gpus), None off a known one."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key in ("H200", "H100", "A100", "L40S", "B200"):
        if key in name:
            if key == "A100":
                return "A100-80GB" if torch.cuda.get_device_properties(0).total_memory > 50e9 \
                    else "A100-40GB"
            return key
    return None


def _lengths(cfg, history: list[dict], response_lengths=None) -> dict:
    """The workload's lengths as the probe steps measured them: the mean and longest prompt and
    the response lengths, as observed (`response_lengths`: representative points of the steps'
    trained responses, pooled) or else as a distribution fitted to their statistics (hybridflow.cost.lengths.from_metrics:
    mean, longest, shortest, share at the cap); with nothing measured, the config's maxima."""
    from hybridflow.cost.lengths import from_metrics

    maxima = dict(prompt_len=cfg.data.max_prompt_length, response_len=cfg.rollout.max_new_tokens)
    try:
        out = from_metrics(list(history), cap=cfg.rollout.max_new_tokens,
                           num_rows=cfg.data.prompts_per_step * cfg.rollout.n)
    except ValueError:  # nothing measured (or nothing the fit can use): responses as long as allowed
        return maxima
    if response_lengths:
        out["response_lengths"] = tuple(response_lengths)
    return {"prompt_len": maxima["prompt_len"], **out}


def _length_stats(history: list[dict], response_lengths=None) -> dict:
    """probe.json's "lengths": what `python -m hybridflow.cost --lengths probe.json` reads (with
    `response_lengths`, representative points of the observed lengths, which it takes over the
    statistics)."""
    def med(key):
        vals = [h[key] for h in history if key in h]
        return statistics.median(vals) if vals else None

    out = {"mean": med("response_length/mean"), "min": med("response_length/min"),
           "clip_ratio": med("response_length/clip_ratio"),
           "max": max((h["response_length/max"] for h in history if "response_length/max" in h),
                      default=None)}
    if med("prompt_length/mean") is not None:
        out["prompt_len"] = round(med("prompt_length/mean"))
        out["prompt_len_max"] = max(out["prompt_len"], round(max(
            h.get("prompt_length/max", 0) for h in history)))
    if response_lengths:
        out["response_lengths"] = list(response_lengths)
    return {k: v for k, v in out.items() if v is not None}


def _prediction(cfg, gpu: str, world: int, history: list[dict] = (),
                response_lengths=None) -> dict:
    from hybridflow.cost import estimate_memory, estimate_options, estimate_step_time
    from hybridflow.cost.from_config import plan_for, workload_fields
    from hybridflow.models.attention import fa4_installed

    kw = dict(model=cfg.model, gpu=gpu, num_gpus=world, layout=plan_for(cfg, world),
              **workload_fields(cfg, decode_kernels=_decode_kernels(cfg),
                                lengths=_lengths(cfg, list(history), response_lengths), gpu=gpu,
                                fa4_installed=fa4_installed()))
    mem = estimate_memory(**kw)
    timing = {(k if k.startswith("timing_s/") else f"timing_s/{k}"): v
              for k, v in estimate_step_time(**kw).items()}
    return {"timing_s": timing, "peak_memory_gb": mem.peak_gib,
            "peak_phase": mem.peak_phase, "consider": estimate_options(**kw)}


def write_probe(cfg, history: list[dict], *, price_per_gpu_hour: float | None = None,
                remaining_steps: int | None = None, response_lengths=None) -> dict:
    """Rank 0 writes probe.json and prints a summary; returns the record on every rank.
    `remaining_steps`: steps the run still has to do (total_steps when it starts from scratch).
    `response_lengths`: the probe steps' trained response lengths, pooled (else the lengths are
    fitted to the steps' statistics); the prediction and probe.json take their representative
    points (hybridflow.cost.lengths.quantile_points)."""
    from hybridflow.cost.lengths import quantile_points

    points = quantile_points(response_lengths) if response_lengths else None
    world = dist.get_world_size()
    later = history[1:] or history
    stages = sorted({k for h in later for k in h if k.startswith("timing_s/")})
    timing = {k: statistics.median(h[k] for h in later if k in h) for k in stages}
    mem_key = "perf/max_memory_allocated_gb" if torch.cuda.is_available() else "perf/max_rss_gb"
    peak = max((h.get(mem_key, 0.0) for h in history), default=0.0)
    step_s = timing.get("timing_s/step", 0.0)
    todo = cfg.trainer.total_steps if remaining_steps is None else remaining_steps
    hours = step_s * todo / 3600
    gpu = gpu_name()
    record = {"probe_steps": len(history), "num_gpus": world, "device": gpu or "cpu",
              "measured": {"timing_s": timing, "peak_memory_gb": peak,
                           "reward_trend": [h.get("critic/score/mean") for h in history]},
              "full_run": {"total_steps": cfg.trainer.total_steps, "remaining_steps": todo,
                           "hours": hours, "gpu_hours": hours * world}}
    if any("response_length/mean" in h for h in history):
        record["lengths"] = _length_stats(history, points)
    if gpu is not None:
        from hybridflow.cost import get_gpu

        price = price_per_gpu_hour if price_per_gpu_hour is not None else get_gpu(gpu).price_per_hour
        record["full_run"]["cost"] = hours * world * price
        record["full_run"]["price_per_gpu_hour"] = price
        try:
            record["predicted"] = _prediction(cfg, gpu, world, history, points)
        except (ValueError, KeyError) as e:  # a model the cost model cannot describe
            record["predicted"] = {"error": str(e)}
    if dist.get_rank() == 0:
        path = os.path.join(cfg.trainer.output_dir, "probe.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2)
        os.replace(tmp, path)
        pred = record.get("predicted", {}).get("timing_s", {})
        print(f"probe: {len(history)} steps on {world} x {record['device']}  ->  {path}")
        print(f"  {'stage':18s} {'measured s':>11s} {'predicted s':>12s}")
        for k, v in timing.items():
            name = k.split("/", 1)[1]
            p = pred.get(k)
            print(f"  {name:18s} {v:11.3f} {p if p is None else round(p, 3)!s:>12s}")
        print(f"  peak memory/GPU   {peak:.1f} GB"
              + (f"  (predicted {record['predicted'].get('peak_memory_gb', float('nan')):.1f})"
                 if "predicted" in record and "peak_memory_gb" in record["predicted"] else ""))
        for line in record.get("predicted", {}).get("consider", []):
            print(f"  the cost model would {line}")
        full = record["full_run"]
        print(f"  full run: {cfg.trainer.total_steps} steps ({todo} to go) ~ {full['hours']:.2f} h, "
              f"{full['gpu_hours']:.2f} GPU-h" + (f", ${full['cost']:.2f}" if "cost" in full else ""))
    return record


class Probe:
    """A step consumer: records `trainer.probe_steps` steps from `start_step`, asks the run to stop
    there, and writes probe.json at the end (forecasting the steps the run still had to do)."""

    save_on_stop = False  # a probe measures; it leaves no checkpoint behind

    def __init__(self, cfg, *, start_step: int):
        self.cfg, self.start = cfg, start_step
        self.stop_at = min(cfg.trainer.total_steps, start_step + cfg.trainer.probe_steps)
        self.history: list[dict] = []
        self.response_lengths: list[int] = []

    def on_lengths(self, step: int, lengths) -> None:
        """The step's trained response lengths (the trainer calls it before `on_step`)."""
        self.response_lengths.extend(int(n) for n in lengths or ())

    def on_step(self, step: int, metrics: dict) -> bool:
        self.history.append(metrics)
        return step >= self.stop_at

    def on_end(self) -> None:
        t = self.cfg.trainer
        write_probe(self.cfg, self.history, price_per_gpu_hour=t.price_per_gpu_hour,
                    remaining_steps=t.total_steps - self.start,
                    response_lengths=self.response_lengths or None)


def _decode_kernels(cfg) -> str:
    """The cost model's decode path for rollout.decode_kernels ("auto": triton on a GPU; the
    model's head_dim is not checked here)."""
    value = cfg.rollout.decode_kernels
    if value == "auto":
        return "triton" if torch.cuda.is_available() else "torch"
    return value
