"""`[torchrun ...] tests/dist/fault_entry.py <hydra overrides>`: hybridflow.train with one fault
injected, chosen by the environment variable HYBRIDFLOW_TEST_FAULT="<rank>:<where>:<action>":

  <rank>:start:delay       sleep 2 s before starting (forces which rank reaches an error last)
  <rank>:<stage>:kill      SIGKILL on entering the stage (a crashed process: OOM killer, segfault)
  <rank>:<stage>:hang      sleep on entering the stage (a stuck peer: the others' collectives wait)
  <rank>:<stage>:error     raise a ValueError on entering the stage (a user error one rank finds)
  0:<step>:crash_publish   exit (code 9) after step_<step> is renamed into place, before `latest`
                           is rewritten (the window of issue 14, item 3)
  <rank>:<step>:nan_grad   from step <step> on, this rank's actor loss is multiplied by NaN (every
                           gradient inf/NaN: the skipped-update path of hybridflow.nonfinite)

Only the test suite runs this; hybridflow itself has no fault hooks.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager

from hybridflow.train import main

rank_s, where, action = os.environ["HYBRIDFLOW_TEST_FAULT"].split(":")
me = os.environ.get("RANK", "0") == rank_s

if action == "delay":
    if me:
        time.sleep(2.0)
elif action in ("kill", "hang", "error"):
    from hybridflow import watchdog

    real_stage = watchdog.stage

    @contextmanager
    def stage(name):
        with real_stage(name):
            if me and name == where:
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if action == "error":
                    raise ValueError(f"injected error on rank {rank_s} in stage {name}")
                time.sleep(3600)
            yield

    watchdog.stage = stage
elif action == "crash_publish":
    from hybridflow import checkpoint

    real_write_latest = checkpoint._write_latest

    def write_latest(root_dir, step):
        if me and step == int(where) and os.path.isdir(checkpoint.step_dir(root_dir, step)):
            sys.stdout.flush()
            os._exit(9)
        real_write_latest(root_dir, step)

    checkpoint._write_latest = write_latest
elif action == "nan_grad":
    from hybridflow import trainer as tr

    real_update, real_objective = tr.Trainer.update, tr.actor_objective

    def poisoned(*args, **kwargs):
        loss_fn = real_objective(*args, **kwargs)

        def nan_loss(out, mb):
            loss, metrics = loss_fn(out, mb)
            return loss * float("nan"), metrics

        return nan_loss

    def update(self, engine, batch, objective, **kwargs):
        if me and objective is real_objective and self.step + 1 >= int(where):
            objective = poisoned
        return real_update(self, engine, batch, objective, **kwargs)

    tr.Trainer.update = update
else:
    raise SystemExit(f"unknown fault action {action!r}")

sys.exit(main())
