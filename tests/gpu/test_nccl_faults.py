"""Peer failures under NCCL on 2 GPUs: every surviving rank ends with its stage/rank line.

- A rank SIGKILLed entering old_log_prob (TP=2): NCCL does not notice a dead peer by itself (the
  survivor's all-reduce would wait for the collective timeout); torchrun's SIGTERM reaches the
  survivor's watcher thread while its main thread is blocked, and it prints
  `rank 0: stage old_log_prob: peer failure after T s`, long before the timeout.
- A rank that hangs entering adv (DP=2): the survivor's NCCL watchdog aborts it after
  trainer.collective_timeout_s (NCCL's own message), and the hung rank then prints its line when
  torchrun stops it. The job ends within the timeout plus start-up.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.dist.test_torchrun_faults import _error_lines, _fault_run

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def test_killed_peer_under_nccl(tmp_path):
    out, _ = _fault_run("1:old_log_prob:kill", tmp_path, "parallel.tensor_parallel_size=2",
                        "trainer.collective_timeout_s=300")
    lines = _error_lines(out)
    m = re.fullmatch(r"hybridflow train: error: rank 0: stage old_log_prob: peer failure after "
                     r"([\d.]+) s \(.+\)", lines[0]) if len(lines) == 1 else None
    assert m and float(m.group(1)) < 60, out[-4000:]


def test_hung_peer_under_nccl(tmp_path):
    timeout_s = 20
    out, wall = _fault_run("1:adv:hang", tmp_path, f"trainer.collective_timeout_s={timeout_s}")
    lines = _error_lines(out)
    assert any(re.fullmatch(r"hybridflow train: error: rank 1: stage adv: peer failure after [\d.]+ s "
                            r"\(SIGTERM: .+\)", ln) for ln in lines), out[-4000:]
    assert wall < timeout_s + 240, wall
