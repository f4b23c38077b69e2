"""CUDA-graph capture of the decode step, per batch-size bucket, and host-sync-free stop polling.

At RL batch sizes one decode step is a few hundred small kernels (embedding, 24 x ~15 per layer,
logits, sampling), so launch overhead, not bandwidth, bounds an eager loop (shared/MEGATRON_CPU.md:
12.9 s eager Megatron vs a 0.06 s weight-read floor). `GraphedStep` captures a zero-argument step
that reads and writes only static buffers (KV cache views, token/position/step tensors, the output
rows) and replays it with one launch.

Buckets: batch sizes round up to a power of two, capped by `max_batch_size` (which is a bucket
itself), so a few graphs serve every chunk size; rows beyond the real batch are marked finished and
cost compute but no correctness. All buckets share one memory pool (they never run concurrently).
Randomness: the sampler's seeded `torch.Generator` is registered with each graph, so every replay
advances its Philox offset as an eager step would, and re-seeding between calls reproduces draws.
"""

from __future__ import annotations

from typing import Callable

import torch


def bucket_sizes(max_batch_size: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


def bucket_for(rows: int, max_batch_size: int) -> int:
    return next(b for b in bucket_sizes(max_batch_size) if b >= rows)


# eager runs of a step before its capture (cuBLAS/SDPA workspaces and lazy inits): they run on
# whatever the step's buffers hold then, so a step must keep its indices in range on that state
WARMUP = 2


class GraphedStep:
    """`fn` captured once (after `warmup` eager runs on a side stream); calling replays it. The
    graph reads the addresses of every tensor `fn` closes over, so `fn` is kept: dropping it would
    free those tensors (index ramps, stop ids made by a step's factory) to the allocator while
    the graph still reads them."""

    def __init__(self, fn: Callable[[], None], *, pool, side: torch.cuda.Stream,
                 generator: torch.Generator | None, warmup: int = WARMUP):
        self.fn = fn
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # cuBLAS/SDPA workspaces and lazy inits happen here
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        if generator is not None:
            self.graph.register_generator_state(generator)
        with torch.cuda.graph(self.graph, pool=pool):
            fn()

    def __call__(self) -> None:
        self.graph.replay()


class WarmedStep:
    """GraphedStep's host-side twin (DecodeOptions.emulate_graphs, off a GPU): the same `warmup`
    eager runs of `fn` at construction, then `fn` itself per call where a GPU replays the graph
    (the capture run executes nothing on a GPU, so it has no twin here)."""

    def __init__(self, fn: Callable[[], None], *, warmup: int = WARMUP):
        for _ in range(warmup):
            fn()
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


def free_workspaces() -> None:
    """Drop cuBLAS workspaces (allocator memory, one per handle x stream; the warm-up side stream
    gets its own) and the cached blocks, so memory_allocated() returns to its pre-generation value.
    Private API, also used by torch's own cudagraph trees; workspaces are re-made on demand."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


class StopPoller:
    """Reads a device count (a 1-element int64, e.g. the live rows) every few steps without
    stalling the GPU.

    Each `poll(count)` snapshots `count` into pinned memory asynchronously and then returns the
    snapshot of the PREVIOUS poll (None at the first), waiting only for that older event. The CPU
    thus runs at most two periods ahead of the GPU, the GPU queue never drains, and the value is
    deterministic (the same on every TP rank, which must issue the same number of
    collective-bearing replays and take the same compaction decisions). For a count that only
    falls (live rows) the stale value is an upper bound of the current one.
    On CPU the count is read directly (ops are synchronous there).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = [torch.zeros(1, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
        self.count = 0

    def reset(self) -> None:
        """Start over (a new decode loop), keeping the pinned buffers and events: allocating
        pinned memory is a slow host call (a page-locking syscall) the GPU would wait for."""
        self.count = 0

    def poll(self, count: torch.Tensor) -> int | None:
        if not self.cuda:
            return int(count)
        i = self.count % 2
        self.host[i].copy_(count.reshape(1), non_blocking=True)
        self.events[i].record()
        self.count += 1
        if self.count < 2:
            return None
        prev = 1 - i
        self.events[prev].synchronize()
        return int(self.host[prev].item())
