"""Resumable, DP-sharded sampler of prompt indices.

Every rank builds the same sampler (same seed) and so walks the same global batches; rank r takes
the contiguous slice [r * B/D, (r + 1) * B/D) of each global batch of B indices (D = dp_size).
No communication is needed.

Choices:
- Each epoch is a fresh permutation from numpy's PCG64 seeded with the pair (seed, epoch): stable
  across library versions and platforms, and seeds do not alias (seed 0 epoch 1 != seed 1 epoch 0).
- `drop_last=True` skips the tail that does not fill a batch; with `drop_last=False` the last batch
  is filled up from the start of the same permutation, so every step has exactly B prompts (group
  sizes and loss scaling downstream assume a fixed batch).
- The state is (epoch, step within the epoch, offset). The DP size is not part of it: a run resumed
  on a different number of DP ranks sees the same global batches, only sliced differently. Resumed
  on other data (`restart_epoch`), the saved epoch starts again over the new items.
- `next_prompts(count)` takes fewer (or more) than a batch: the next `count` of this rank's slices,
  in order, spanning batches; `offset` is how many of the current batch's local slice are taken
  (every rank takes the same counts). A run resumed with a part of a batch taken on another number
  of DP ranks (whose slices differ) goes on at the next batch: the rest of that one is skipped.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np


class PromptSampler:
    def __init__(self, num_items: int, *, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True, drop_last: bool = True):
        if batch_size <= 0 or dp_size <= 0:
            raise ValueError(f"batch_size ({batch_size}) and dp_size ({dp_size}) must be positive")
        if batch_size % dp_size != 0:
            raise ValueError(f"batch_size {batch_size} is not divisible by dp_size {dp_size}; each DP rank "
                             "needs the same number of prompts")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if num_items <= 0 or (drop_last and num_items < batch_size):
            raise ValueError(f"dataset has {num_items} prompts, fewer than batch_size {batch_size}; with "
                             "drop_last=True an epoch would have no steps")
        self.num_items = num_items
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.step_in_epoch = 0
        self.offset = 0  # of the current batch's local slice, taken by next_prompts
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_items // self.batch_size
        return -(-self.num_items // self.batch_size)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.dp_size

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_items)
            else:
                order = np.arange(self.num_items)
            pad = self.steps_per_epoch * self.batch_size - self.num_items  # > 0 only without drop_last
            if pad > 0:
                order = np.concatenate([order, np.resize(order, pad)])
            self._order_epoch, self._order = self.epoch, order
        return self._order

    def global_batch(self) -> list[int]:
        """The next step's B indices (all ranks), without advancing."""
        start = self.step_in_epoch * self.batch_size
        return self._epoch_order()[start:start + self.batch_size].tolist()

    def next_batch(self) -> list[int]:
        """This rank's B/D indices for the next step; moves on, into the next epoch at the end."""
        return self.next_prompts(self.local_batch_size)

    def next_prompts(self, count: int) -> list[int]:
        """This rank's next `count` indices: the rest of the current batch's local slice, then the
        next batches' (into the next epoch at an epoch's end)."""
        if count < 0:
            raise ValueError(f"next_prompts: count must be >= 0, got {count}")
        out, L = [], self.local_batch_size
        while len(out) < count:
            batch = self.global_batch()
            local = batch[self.dp_rank * L:(self.dp_rank + 1) * L]
            take = min(count - len(out), L - self.offset)
            out += local[self.offset:self.offset + take]
            self.offset += take
            if self.offset == L:
                self._advance()
        return out

    def _advance(self) -> None:
        self.offset = 0
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch, one local batch per step."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "offset": self.offset,
                "dp_size": self.dp_size, "seed": self.seed, "num_items": self.num_items,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any], *, restart_epoch: bool = False) -> None:
        """Continue where `state` stopped. restart_epoch: the data changed (the trainer's
        trainer.resume_allow_data_change): the saved epoch starts again from its first batch over
        this sampler's items, whose count may differ."""
        for key in ("seed", "num_items", "batch_size", "shuffle", "drop_last"):
            if key == "num_items" and restart_epoch:
                continue
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this run has {getattr(self, key)!r}; "
                                 "resuming would not continue the same batches")
        for key in ("epoch", "step_in_epoch"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise ValueError(f"sampler state: {key} must be a non-negative int, got {state.get(key)!r}")
        offset = state.get("offset", 0)  # absent in states saved before it
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"sampler state: offset must be a non-negative int, got {offset!r}")
        if restart_epoch:
            state, offset = {**state, "step_in_epoch": 0}, 0
        if state["step_in_epoch"] >= self.steps_per_epoch:
            raise ValueError(f"sampler state: step_in_epoch {state['step_in_epoch']} is past steps_per_epoch "
                             f"{self.steps_per_epoch}")
        self.epoch, self.step_in_epoch, self.offset = state["epoch"], state["step_in_epoch"], 0
        if offset and state.get("dp_size", self.dp_size) != self.dp_size:
            self._advance()  # another DP size slices that batch otherwise: go on at the next one
        elif offset:
            if offset >= self.local_batch_size:
                raise ValueError(f"sampler state: offset {offset} is past the local batch size "
                                 f"{self.local_batch_size}")
            self.offset = offset
