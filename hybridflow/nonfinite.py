"""Optimizer steps skipped for inf/NaN gradients: said, saved for replay, and bounded.

`Engine.train_step` skips a step whose gradient is not finite on some rank (every rank agrees: the
flag is all-reduced), so the weights stay as they were. This module is the trainer's side:
- each skipped update prints one line on rank 0 (step, role, mini-batch) and its mini-batch, as
  every rank held it, is written to `<output_dir>/nonfinite/step<S>_<role>_e<epoch>_mb<i>_rank<r>.pt`
  (a dict of CPU tensors; `replay_batch` turns it back into a RolloutBatch) so that the cause can be
  found offline by running the same update again;
- `trainer.max_skipped_steps` steps in a row in which every update of some role was skipped end the
  run with `NonFiniteGradients` (`rank R: stage update_actor: non-finite gradients ...`, exit 1):
  a run that can no longer take a step should not burn its allocation.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from hybridflow.data.batch import RolloutBatch


class NonFiniteGradients(RuntimeError):
    """Every update was skipped for trainer.max_skipped_steps steps in a row."""


def save_batch(path: str, batch: RolloutBatch) -> None:
    """The batch's tensors (CPU) at `path`, written atomically."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    tensors = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in fields.items()}
    tmp = f"{path}.tmp"
    torch.save(tensors, tmp)
    os.replace(tmp, path)


def replay_batch(path: str) -> RolloutBatch:
    return RolloutBatch(**torch.load(path, weights_only=True))


class SkippedUpdates:
    def __init__(self, *, output_dir: str, max_skipped_steps: int, rank: int):
        self.dir = os.path.join(output_dir, "nonfinite")
        self.max_steps, self.rank = max_skipped_steps, rank
        self.in_a_row = 0
        self._step_roles: dict[str, list[bool]] = {}

    def record(self, *, step: int, role: str, epoch: int, index: int, batch: RolloutBatch,
               skipped: bool) -> None:
        """One optimizer update of `role` at `step` (1-based, the step being run)."""
        self._step_roles.setdefault(role, []).append(skipped)
        if not skipped:
            return
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"step{step}_{role}_e{epoch}_mb{index}_rank{self.rank}.pt")
        save_batch(path, batch)
        if self.rank == 0:
            print(f"hybridflow: warning: step {step}: {role} update {index} of epoch {epoch} "
                  f"skipped: inf/NaN gradient (weights unchanged); its mini-batch: {path}",
                  flush=True)

    def end_step(self, step: int) -> None:
        """After the step's updates: count it if some role had all of its updates skipped."""
        lost = [r for r, flags in self._step_roles.items() if flags and all(flags)]
        self._step_roles = {}
        self.in_a_row = self.in_a_row + 1 if lost else 0
        if self.max_steps and self.in_a_row >= self.max_steps:
            raise NonFiniteGradients(
                f"non-finite gradients: every {'/'.join(lost)} update of the last {self.in_a_row} "
                f"steps (to step {step}) was skipped (trainer.max_skipped_steps="
                f"{self.max_steps}); the weights are those of step {step - self.in_a_row}; "
                f"the mini-batches are in {self.dir}")
