"""The decode step of multi-turn generation as one graph-capturable function over static state.

`DecodeState` holds everything the step reads and writes, allocated once per chunk size B (and
cache length): the next-token logits of every row, each row's next cache column and position, its
valid cache columns, the host's per-step control row and the step's output row. `decode_step`
returns a zero-argument function that
1. draws a token for every row from `logits` (rollout.temperature / top_k / top_p, the generator's
   seeded stream), replaces it by the forced token where the control row says so (replays and
   tests), and writes each row's token and its log-prob (log_softmax(logits / T), as `sample`'s)
   into `out`, one (2, B) tensor: the host reads it with one device-to-host copy per step;
2. feeds the drawn token of every `ready` row through `extend` (multi_turn.py) at the row's column
   and position (other rows: a masked token in the scratch column, never marked valid), writing
   the next logits into `logits` in place and advancing `col` / `pos` of the fed rows.
Every op has a static shape and no host sync, so on a GPU the function is captured once per state
size (cuda_graph.GraphedStep: the generator's pool, side stream and registered RNG) and each step
is one replay; on CPU or with rollout.cuda_graphs off it runs eagerly, the same ops. With
rollout.decode_kv_window W there is one step per window (the multiples of W below T, and T): the
host picks, per step, the shortest that holds every state row's next column (it knows each row's
length; no sync), so early steps do not read the whole cache. Appending tool results stays eager
(`extend` of S > 1 tokens for the resumed rows) and writes the same tensors in place (`col`,
`pos`, `key_valid`, the cache, the resumed rows' `logits`).

Beside it, the host's side: `Rows` (each row's tokens, log-probs, tool mask, lengths, turn and
state as numpy arrays) and `Slots` (which state row holds which chunk row; compaction moves the
unfinished rows into a smaller state).

A row whose drawn token stops it or closes a tool call was fed too: its K/V sits at its next
column as it would after an append (a call's closing token goes into the cache first either way),
and a finished row's cache is never read again.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from hybridflow.config import RolloutConfig
from hybridflow.rollout.cuda_graph import GraphedStep, WarmedStep
from hybridflow.rollout.sampling import _token_logprobs, sample


class DecodeState:
    """Static tensors of one chunk of B rows over a cache of T columns and a vocabulary of V."""

    READY, FORCED, FORCED_TOKEN = range(3)  # the rows of `ctrl`

    def __init__(self, rows: int, length: int, vocab: int, device):
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
        self.logits = z(rows, vocab, dt=torch.float32)  # (B, V) each row's next-token logits
        self.col, self.pos = z(rows), z(rows)  # (B,) next cache column, next position
        self.key_valid = z(rows, length, dt=torch.bool)  # (B, T) the columns a row attends to
        # (3, B) written by the host before each step: ready (1: sample and feed the row),
        # forced (1: emit FORCED_TOKEN instead of the draw), the forced token
        self.ctrl = z(3, rows)
        self.out = z(2, rows, dt=torch.float64)  # (2, B) the step's token and its log-prob

    def tensors(self) -> list:
        return [self.logits, self.col, self.pos, self.key_valid, self.ctrl, self.out]

    def reset(self, *, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Start a chunk: the prefill's last-column logits (B, V), the prompts' mask (B, P)."""
        P = mask.shape[1]
        self.logits.copy_(logits)
        self.key_valid.zero_()
        self.key_valid[:, :P] = mask.bool()
        self.col.fill_(P)
        self.pos.copy_(mask.sum(1))
        self.ctrl.zero_()
        self.out.zero_()


class Rows:
    """Host-side record of a chunk's B rows (numpy, updated by whole-array ops per step)."""
    DECODE, TOOL, DONE = range(3)

    def __init__(self, B: int, R: int):
        self.tokens = np.zeros((B, R), dtype=np.int64)  # (B, R) the response so far
        self.logprobs = np.zeros((B, R), dtype=np.float32)  # 0 on tool tokens
        self.tool = np.zeros((B, R), dtype=np.int64)  # 1 on tool-result tokens
        z = lambda: np.zeros(B, dtype=np.int64)  # noqa: E731
        self.n, self.n_model, self.turn_start = z(), z(), z()  # lengths; where the turn began
        self.turns, self.calls, self.errors, self.timeouts = z() + 1, z(), z(), z()
        self.state = z()  # DECODE | TOOL | DONE

    def text_ids(self, b: int, start: int) -> list:
        return self.tokens[b, start:self.n[b]].tolist()


class Slots:
    """Where the chunk's rows sit in the current decode state: compaction moves the rows that are
    not finished (decoding or waiting for a tool) into a smaller state's first slots."""

    def __init__(self, B: int, step):
        self.st, self.fns = step
        self.of = np.arange(B)  # (B,) chunk row -> its slot (-1: dropped, finished)
        self.ctrl = np.zeros((3, B), dtype=np.int64)

    @property
    def size(self) -> int:
        return self.ctrl.shape[1]

    def move(self, keep: np.ndarray, step, cache, *, columns: int) -> None:
        """Rows `keep` (chunk rows) into `step`'s state, slots 0..len(keep)-1 (the rest of its
        slots: copies of dropped rows, never fed); their cache rows over the first `columns`."""
        st, fns = step
        size = st.col.shape[0]
        src = self.of[keep]
        pad = np.setdiff1d(np.arange(self.size), src)[:size - len(src)]
        order = torch.from_numpy(np.concatenate([src, pad])).to(st.col.device)
        for name in ("logits", "col", "pos", "key_valid"):
            getattr(st, name).copy_(getattr(self.st, name).index_select(0, order))
        cache.gather_rows(order, columns=columns)
        self.of[:] = -1
        self.of[keep] = np.arange(len(keep))
        self.st, self.fns, self.ctrl = st, fns, np.zeros((3, size), dtype=np.int64)


def decode_step(gen, st: DecodeState, cfg: RolloutConfig, *, graphed: bool,
                kv_len: Optional[int] = None):
    """The step over `st` on `gen`'s weights, cache and generator, attending over the first
    `kv_len` cache columns (None: all; the caller keeps every row's next column below it):
    captured (graphed, CUDA) or the plain function. The capture's warm-up runs feed no row (ctrl
    is zero) but draw from the generator: seed it after."""
    from hybridflow.rollout.multi_turn import extend

    w, cache, (cos, sin) = gen.w, gen._cache, gen._tables
    inv_temp = 1.0 if cfg.temperature == 0.0 else 1.0 / cfg.temperature

    def step():
        tok, _ = sample(st.logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        generator=gen._rng)
        tok = torch.where(st.ctrl[DecodeState.FORCED].bool(), st.ctrl[DecodeState.FORCED_TOKEN],
                          tok)
        st.out[0].copy_(tok)
        st.out[1].copy_(_token_logprobs(st.logits, tok, inv_temp))
        ready = st.ctrl[DecodeState.READY]
        extend(w, tok[:, None], st.pos[:, None], ready.bool()[:, None], st.col, cache=cache,
               key_valid=st.key_valid, cos_tab=cos, sin_tab=sin, out=st.logits, kv_len=kv_len)
        st.col.add_(ready)
        st.pos.add_(ready)

    if not graphed:
        return step
    st.ctrl.zero_()
    if gen.device.type != "cuda":  # DecodeOptions.emulate_graphs: the warm-ups, then eager calls
        return WarmedStep(step)
    if gen._pool is None:
        gen._pool, gen._side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    return GraphedStep(step, pool=gen._pool, side=gen._side, generator=gen._rng)
