"""Stage timers and metric sinks: TensorBoard, `<output_dir>/metrics.jsonl`, console progress bar.

Metric names follow verl's so dashboards compare: `timing_s/<stage>`,
`perf/throughput` (tokens / (step seconds x GPUs)), `perf/max_memory_allocated_gb`, `actor/*`,
`critic/*`, `response_length/*`. Only global rank 0 writes; every rank times (the stages are
collective, so their times agree up to skew). On GPU, timers wait for the current stream at stage
boundaries so a stage's time is its own (side streams, such as the reference's prefetch, run on).
A timed stage is also the stage the watchdog names when something fails in it. The sinks open
their files at start-up: an OSError there names the file and errno (tensorboard missing is only a
note).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager

import torch

from hybridflow import watchdog


class StageTimer:
    """Seconds per stage. On CUDA a stage waits for the current stream's work at its edges (not the
    whole device: a side stream's copy, such as the reference's prefetch, runs on across stages
    until something waits for it)."""

    def __init__(self):
        # (start, end) of each time a stage ran, on time.perf_counter (gpu_monitor's samples)
        self.spans: dict[str, list[tuple[float, float]]] = {}

    @contextmanager
    def __call__(self, name: str):
        with watchdog.stage(name), torch.profiler.record_function(f"stage/{name}"):
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            try:
                yield
            finally:
                if torch.cuda.is_available():
                    torch.cuda.current_stream().synchronize()
                self.spans.setdefault(name, []).append((t0, time.perf_counter()))

    def metrics(self) -> dict[str, float]:
        """Seconds per stage: the sum of its spans."""
        return {f"timing_s/{k}": sum(b - a for a, b in v) for k, v in self.spans.items()}


def memory_metrics() -> dict[str, float]:
    if not torch.cuda.is_available():
        try:
            import resource

            rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            return {"perf/max_rss_gb": rss_gb}
        except Exception:
            return {}
    # alloc_retries (so far in the run): each time the caching allocator found no free block, it
    # freed its cache, synchronised the device and asked CUDA again; a count that grows step after
    # step says the memory cap (trainer.gpu_memory_limit_gib) or fragmentation is costing time.
    # device_allocs / device_frees (so far): the allocator's cudaMalloc / cudaFree calls; once the
    # run's shapes have been seen they stop growing, unless each step's shapes need new blocks
    stats = torch.cuda.memory_stats()
    return {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
            "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
            "perf/alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "perf/device_allocs": float(stats.get("num_device_alloc", 0)),
            "perf/device_frees": float(stats.get("num_device_free", 0))}


class MetricsLogger:
    """Writes one JSON object per step to metrics.jsonl, scalars to TensorBoard, and a progress bar;
    and each step's trained response lengths, one line per step, to rollout_lengths.jsonl (what
    `python -m hybridflow.cost --lengths` reads for the run's exact length distribution: the
    statistics in metrics.jsonl only pin a fitted shape)."""

    METRICS_FILE = "metrics.jsonl"
    LENGTHS_FILE = "rollout_lengths.jsonl"

    CONSOLE = (("critic/score/mean", "reward"), ("response_length/mean", "len"),
               ("actor/ppo_kl", "kl"), ("actor/entropy", "ent"), ("timing_s/step", "s/step"))

    def __init__(self, output_dir: str, *, total_steps: int, enabled: bool, tensorboard: bool,
                 progress_bar: bool, start_step: int = 0):
        self.enabled = enabled
        self.writer = self.bar = self.file = self.lengths_file = None
        self.output_dir = output_dir
        if not enabled:
            return
        path = os.path.join(output_dir, self.METRICS_FILE)
        try:
            os.makedirs(output_dir, exist_ok=True)
            self.file = open(path, "a", buffering=1)
        except OSError as e:
            raise OSError(e.errno, f"cannot open the metrics log: {e.strerror}",
                          e.filename or path) from None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard missing: keep going, say so once
                print(f"[hybridflow] tensorboard disabled: {e}")
            else:
                tb_dir = os.path.join(output_dir, "tensorboard")
                try:
                    self.writer = SummaryWriter(tb_dir)
                except OSError as e:
                    self.file.close()
                    raise OSError(e.errno, f"cannot write tensorboard events: {e.strerror}",
                                  e.filename or tb_dir) from None
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        if self.writer is not None:
            for k, v in clean.items():
                self.writer.add_scalar(k, v, step)
        summary = "  ".join(f"{short}={clean[k]:.3g}" for k, short in self.CONSOLE if k in clean)
        if self.bar is not None:
            self.bar.set_postfix_str(summary, refresh=False)
            self.bar.update(1)
        else:
            print(f"step {step}  {summary}", flush=True)

    def log_lengths(self, step: int, lengths) -> None:
        """Append the step's response lengths (a sequence of ints) to rollout_lengths.jsonl."""
        if not self.enabled or lengths is None:
            return
        if self.lengths_file is None:
            path = os.path.join(self.output_dir, self.LENGTHS_FILE)
            try:
                self.lengths_file = open(path, "a", buffering=1)
            except OSError as e:
                raise OSError(e.errno, f"cannot open the rollout lengths log: {e.strerror}",
                              e.filename or path) from None
        self.lengths_file.write(json.dumps({"step": step,
                                            "response_lengths": [int(n) for n in lengths]}) + "\n")

    def print(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def summary(self, history: list[dict], *, first_step: int = 1, key: str = "critic/score/mean",
                windows: int = 10) -> None:
        """Print the reward curve as window means, e.g. `steps 1-20: 0.27 | 21-40: 0.31 | ...`.
        history[i] is step first_step + i (a resumed run starts after its checkpoint)."""
        steps = [first_step + i for i, h in enumerate(history) if key in h]
        values = [h[key] for h in history if key in h]
        if not self.enabled or not values:
            return
        size = max(1, -(-len(values) // windows))
        parts = []
        for start in range(0, len(values), size):
            chunk = values[start:start + size]
            span = steps[start:start + size]
            parts.append(f"{span[0]}-{span[-1]}: {sum(chunk) / len(chunk):.3f}")
        self.print("mean reward by steps  " + " | ".join(parts))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.lengths_file is not None:
            self.lengths_file.close()


class TimeBudget:
    """A step consumer that ends the run before a step would finish past `seconds` after it was
    built (the next step, validation included, is assumed to take as long as the longest so far).
    Rank 0's clock decides and every rank follows, so all stop at the same step; the trainer then
    checkpoints."""

    save_on_stop = True

    def __init__(self, seconds: float):
        self.seconds, self.start, self.longest = seconds, time.monotonic(), 0.0

    def on_step(self, step: int, metrics: dict) -> bool:
        import torch.distributed as dist

        self.longest = max(self.longest, metrics.get("timing_s/step", 0.0)
                           + metrics.get("timing_s/val", 0.0))
        stop = time.monotonic() - self.start + self.longest > self.seconds
        flag = [stop]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(flag, src=0)
        if flag[0] and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"trainer.time_budget_s={self.seconds:g} reached after step {step}: "
                  "saving and stopping (resume continues from here)", flush=True)
        return bool(flag[0])

    def on_end(self) -> None:
        pass
