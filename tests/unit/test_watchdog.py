"""The watchdog's stage bookkeeping and its lines for collective failures and CUDA OOM.

The messages are the ones torch 2.13's gloo and CUDA caching allocator raise (copied from real
runs: a SIGKILLed peer, a peer silent past the timeout, an H200 OOM); an OOM cannot be provoked
on a CPU machine, so it is a constructed torch.OutOfMemoryError. Real peer deaths and timeouts
are in tests/dist/test_faults.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from hybridflow import watchdog
from hybridflow.metrics import StageTimer

RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
         "[127.0.0.1]:60053: Connection reset by peer. This is typically caused by a remote worker "
         "hanging or bugs in the application.")
TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed "
           "out waiting 2000ms for recv operation to complete")
OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of "
       "which 1.25 GiB is free. Including non-PyTorch memory, this process has 138.50 GiB memory "
       "in use.")


def _raised_in(stages, exc):
    """Raise `exc` inside nested StageTimer stages; return it as the entry point sees it."""
    timer = StageTimer()
    with pytest.raises(type(exc)) as info:
        with timer(stages[0]):
            if len(stages) > 1:
                with timer(stages[1]):
                    raise exc
            raise exc
    return info.value


def test_stages_nest_and_tag_the_innermost():
    assert watchdog.current()[0] == "startup"
    with watchdog.stage("train"):
        with StageTimer()("gen"):
            assert watchdog.current()[0] == "gen"
        assert watchdog.current()[0] == "train"
    e = _raised_in(["step", "old_log_prob"], RuntimeError(RESET))
    assert e.hybridflow_stage[0] == "old_log_prob" and e.hybridflow_stage[1] >= 0
    assert watchdog.current()[0] == "startup"


def test_collective_failure_lines():
    line = watchdog.failure_line(_raised_in(["step", "adv"], RuntimeError(RESET)), rank=1)
    assert re.fullmatch(r"rank 1: stage adv: peer failure after \d+\.\d s \(Read error "
                        r"\[127\.0\.0\.1\]:60053: Connection reset by peer\)", line), line
    line = watchdog.failure_line(_raised_in(["gen"], torch.distributed.DistBackendError(TIMEOUT)),
                                 rank=0)
    assert line.startswith("rank 0: stage gen: timeout after ") and "waiting 2000ms" in line
    assert watchdog.failure_line(ValueError("bad key"), rank=0) is None
    assert watchdog.failure_line(RuntimeError("shape mismatch"), rank=0) is None


@pytest.mark.parametrize("stage_name,hint", [
    ("gen", "rollout.max_batch_size"), ("reshard", "rollout.tensor_parallel_size"),
    ("ref", "trainer.offload_ref=true"), ("update_actor", "algo.micro_batch_size_per_gpu"),
    ("old_log_prob", "algo.forward_micro_batch_size_per_gpu")])
def test_oom_line_says_stage_amount_and_hint(stage_name, hint):
    line = watchdog.failure_line(_raised_in([stage_name], torch.OutOfMemoryError(OOM)), rank=3)
    assert line.startswith(f"rank 3: stage {stage_name}: CUDA out of memory after ")
    assert "asked for 2.00 GiB with 1.25 GiB free of 139.81 GiB; hint: " in line and hint in line
