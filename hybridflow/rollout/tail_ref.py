"""The reference pass under generation's long tail (trainer.ref_in_gen_tail).

Most rows of a step stop long before the longest: on the GSM8K recipe the mean response is ~300 of
up to 1,024 tokens, and the last few hundred decode steps run a handful of rows, each step a chain
of small latency-bound kernels that leave most of the GPU idle. The reference model's pass over the
rows already finished does not depend on the rows still decoding, so it can run then:

    tail = TailReference(ref, live_rows=64, temperature=T, fwd=micro_batching(algo, forward=True))
    batch = rollout.generate(items, ..., tail=tail)   # tail.start(rows, done) from inside decode
    batch.ref_logprobs = tail.finish(batch)           # the rest of the rows, then one (B, R) tensor

`start` runs `ref.compute_logprobs` on the finished rows in a thread of its own, on a CUDA stream of
its own (the decode loop keeps launching its captured steps meanwhile; the passes' kernels release
the GIL while they run); `finish` waits for it, computes the rows still decoding at `start`, and
places both by row. A row's log-probs do not depend on which rows share its micro-batch (packed
rows attend within themselves; padded rows are masked), so the result is the one pass's up to
the rounding of GEMMs of another shape.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel import _cpu_compat
from hybridflow.rollout.generator import TailHook

# the interpreter's thread switch interval while the pass runs beside decoding: the decode loop
# waits at most this long for the GIL between its launches (Python's default is 5 ms, ~4 tail
# decode steps)
SWITCH_INTERVAL_S = 2e-4


class TailReference(TailHook):
    def __init__(self, ref, *, live_rows: int, temperature: float, fwd: dict,
                 device: torch.device):
        if live_rows < 1:
            raise ValueError(f"trainer.ref_in_gen_tail_rows={live_rows}: expected a positive "
                             f"number of rows")
        self.ref, self.live_rows, self.temperature, self.fwd = ref, live_rows, temperature, fwd
        self.device = torch.device(device)
        self._stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
        self._thread: Optional[threading.Thread] = None
        self._rows = self._out = self._error = self._switch = None
        self.early_rows = 0  # rows of the last step whose pass ran beside decoding

    def start(self, rows: torch.Tensor, batch: RolloutBatch) -> None:
        """The pass over `batch`, rows `rows` of the call's batch, in the background."""
        assert self._thread is None, "one early pass per generation"
        self._rows, self._out, self._error = rows, None, None
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, args=(batch.trimmed(),),
                                        name="hybridflow-tail-ref", daemon=True)
        self._thread.start()

    def _run(self, batch: RolloutBatch) -> None:
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())  # grad mode is per thread
                if self._stream is not None:  # device and stream are per thread too
                    stack.enter_context(torch.cuda.device(self.device))
                    stack.enter_context(torch.cuda.stream(self._stream))
                else:  # megatron on CPU: the shims' device mode is per thread as well
                    stack.enter_context(_cpu_compat.for_thread())
                self._out = self.ref.compute_logprobs(batch, temperature=self.temperature,
                                                      **self.fwd)
        except BaseException as e:  # raised again by finish, in the trainer's thread
            self._error = e

    def finish(self, batch: RolloutBatch) -> torch.Tensor:
        """The reference log-probs (B, R) of `batch`, the generated rows in the call's order: the
        early pass's rows as it computed them, the others now."""
        B, R = batch.response_ids.shape
        if self._thread is None:  # no row finished before the tail (or a short generation)
            self.early_rows = 0
            return self.ref.compute_logprobs(batch, temperature=self.temperature, **self.fwd)
        self._thread.join()
        sys.setswitchinterval(self._switch)
        rows, early, error = self._rows, self._out, self._error
        self._thread = self._rows = self._out = self._error = None
        if error is not None:
            raise RuntimeError("the reference pass beside generation's tail failed "
                               "(trainer.ref_in_gen_tail=false runs it after generation)") from error
        self.early_rows = len(rows)
        out = torch.zeros((B, R), dtype=torch.float32)
        out[rows] = F.pad(early, (0, R - early.shape[1])) if early.shape[1] < R else early[:, :R]
        rest = torch.ones(B, dtype=torch.bool)
        rest[rows] = False
        rest = rest.nonzero()[:, 0]
        if len(rest):
            sub = batch.select(rest).trimmed()
            lp = self.ref.compute_logprobs(sub, temperature=self.temperature, **self.fwd)
            out[rest, :lp.shape[1]] = lp
        return out
