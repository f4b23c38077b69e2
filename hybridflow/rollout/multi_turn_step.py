"""The decode step of multi-turn generation as one graph-capturable function over static state.

`DecodeState` holds everything the step reads and writes, allocated once per chunk size B (and
cache length): the next-token logits of every row (in the generator's dtype, as the single-turn
step's: the decoder's logits are values of that dtype, the fp32 ones `extend` returns too), each
row's next cache column and position, its valid cache columns, the host's per-step control row and
the step's output row. `decode_step` returns a zero-argument function that
1. draws a token for every row from `logits` by the single-turn step's sampler call
   (sampling.sample: rollout.temperature / top_k / top_p, the generator's seeded stream, the
   resolved DecodeOptions' kernels / pdl, compiled with its compile), replaced by the forced token
   where the control row says so (replays and tests; `sample(replace=)`), and writes each row's
   token and its log-prob (log_softmax(logits / T)) into `out`, one (2, B) tensor: the host reads
   it with one device-to-host copy per step;
2. feeds the token of every `ready` row at the row's column and position, writing the next logits
   into `logits` in place and advancing `col` / `pos` of the fed rows. Other rows write their K/V
   into the scratch column (the window's last, L - 1), never marked valid. With
   DecodeOptions.kernels "triton" the feed is the single-turn step itself, decoder.decode_step on
   its fused layers (add_rms_norm kernels, cuBLAS GEMMs with the residual added in place, the
   fused SwiGLU, and kernels/rope_attention.py's one kernel for RoPE + the K/V write + split-KV
   attention) with a cache column per row (cur = col where ready, else L - 1) and the column
   marked valid in the ready rows only; with "torch" it is `extend` of one token (multi_turn.py:
   PyTorch ops, SDPA with an additive mask), the reference the fused path is tested against
   (tests/unit/test_multi_turn_fused.py).
Every op has a static shape and no host sync, so on a GPU the function is captured once per state
size (cuda_graph.GraphedStep: the generator's pool, side stream and registered RNG) and each step
is one replay; on CPU or with rollout.cuda_graphs off it runs eagerly, the same ops. With
rollout.decode_kv_window W there is one step per window (the multiples of W below T, and T): the
host picks, per step, the shortest that holds every state row's next column (it knows each row's
length; no sync), so early steps do not read the whole cache. Appending tool results stays eager
(`extend` of S > 1 tokens for the resumed rows) and writes the same tensors in place (`col`,
`pos`, `key_valid`, the cache, the resumed rows' `logits`). On an fp8 cache
(rollout.kv_cache_dtype=fp8, kernels/kv_fp8.py) `extend` writes the new tokens' codes and scales
and attends over the dequantized columns, its own new tokens too, as the fused step does.

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
import torch.nn.functional as F

from hybridflow.config import RolloutConfig
from hybridflow.kernels.kv_fp8 import Fp8KV, quantize_kv, readable
from hybridflow.rollout import decoder
from hybridflow.rollout.cuda_graph import GraphedStep, WarmedStep
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.sampling import sample


def extend(w: decoder.Weights, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
           start: torch.Tensor, *, cache, key_valid: torch.Tensor, cos_tab, sin_tab,
           rows: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
           kv_len: Optional[int] = None, every_position: bool = False) -> torch.Tensor:
    """Run S new tokens per row against the cache; returns fp32 logits (r, V) at each row's last
    valid new token, or with `every_position` (r, S, V) at every new token (speculative decoding
    checks a row's drafts by them; padding positions' values are meaningless).

    ids, positions (r, S) int64: the tokens and their RoPE positions; valid (r, S) bool, a prefix
    of each row (False: right padding, written to the scratch column L-1 and never seen); start
    (r,) int64: the cache column of each row's first new token (token j goes to start + j). rows
    (r,) int64: the cache rows (None: rows 0..r-1, a view without copies). key_valid (rows, T)
    bool, the columns each cache row may attend to; updated in place with the new tokens'
    columns. `out` (r, V) fp32: the logits are written into it (the decode step's static
    buffer) and it is returned. `kv_len` L (rows None only; None: the cache length T): attend
    over cache columns 0..L-1 only (a strided view, no copy); every row's valid columns and new
    tokens must lie below L - 1 or be column L - 1 itself, which is also the scratch column of
    padding (the caller picks L above every row's next column: a row's own scratch write there
    comes before it reaches that column, which it then overwrites). Same math as
    decoder.forward (torch path)."""
    d = w.dims
    r, S = ids.shape
    hpg, hd = d.heads_per_group, d.head_dim
    assert kv_len is None or rows is None, "attention windows are for the decode step's rows"
    L = cache.length if kv_len is None else kv_len
    steps = torch.arange(S, device=ids.device)
    columns = torch.where(valid, start[:, None] + steps, L - 1)  # (r, S)
    kv_rows = key_valid[:r, :L] if rows is None else key_valid.index_select(0, rows)  # (r, L)
    t = torch.arange(L, device=ids.device)
    # query j sees the row's old columns and new tokens 0..j; a padding query sees its own column
    mask = kv_rows[:, None, :] | ((t >= start[:, None, None]) & (t <= columns[:, :, None])
                                  & valid[:, :, None]) | (t == columns[:, :, None])
    if S == 1:  # every head of a group sees the same columns: one broadcast row
        mask = mask[:, None]  # (r, 1, 1, L)
    else:  # query row h * S + j: head h of the group, new token j
        mask = mask[:, None, None].expand(r, 1, hpg, S, L).reshape(r, 1, hpg * S, L)
    x = decoder.embed(w, ids.masked_fill(~valid, 0)).reshape(r * S, d.hidden)
    # the additive form SDPA would make of the boolean mask in every layer, made once
    bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask,
                                                                              float("-inf"))
    cos = cos_tab[positions][:, :, None, None]  # (r, S, 1, 1, hd)
    sin = sin_tab[positions][:, :, None, None]
    row_ix = (torch.arange(r, device=ids.device) if rows is None else rows)[:, None].expand(r, S)
    for i, layer in enumerate(w.layers):
        h = decoder._norm(x, layer.ln1, d.eps)
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b).view(r, S, d.groups, hpg + 2, hd)
        qk = decoder._qk_norm(qkv[:, :, :, :hpg + 1], layer.q_norm, layer.k_norm, d.eps)
        qk = qk * cos + qk.roll(hd // 2, -1) * sin  # (r, S, G, hpg+1, hd)
        # the heads of a group fold into the query axis (as decode_step's): (r, G, hpg * S, hd)
        # queries against the group's (r, G, L, hd) keys, no per-head K/V copy
        q = qk[:, :, :, :hpg].permute(0, 2, 3, 1, 4).reshape(r, d.groups, hpg * S, hd)
        kc, vc = cache.k[i], cache.v[i]  # (rows, G, T, hd)
        _put(kc, row_ix, columns, qk[:, :, :, hpg])  # (r, S, G, hd) at (row, column)
        _put(vc, row_ix, columns, qkv[:, :, :, hpg + 1])
        k, v = (readable(_rows(c, r, L, rows), q.dtype) for c in (kc, vc))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (r, G, hpg * S, hd)
        a = a.view(r, d.groups, hpg, S, hd).permute(0, 3, 1, 2, 4).reshape(r * S, d.heads * hd)
        x = decoder._row_parallel_add(x, a, layer.proj, w)
        x = decoder._mlp(x, layer, w)
    n_new = valid.sum(1)  # (r,)
    new_valid = (t >= start[:, None]) & (t < (start + n_new)[:, None])  # (r, L)
    if rows is None:
        key_valid[:r, :L] |= new_valid
    else:
        key_valid[rows] = kv_rows | new_valid
    if every_position:
        lg = decoder.logits(w, decoder._norm(x, w.final_ln, d.eps)).view(r, S, -1)
        return lg if out is None else out.copy_(lg)
    last = (valid.long().cumsum(1).argmax(1))  # the last valid new token of each row
    h = x.view(r, S, d.hidden)[torch.arange(r, device=ids.device), last]
    lg = decoder.logits(w, decoder._norm(h, w.final_ln, d.eps), fp32=out is None)
    return lg if out is None else out.copy_(lg)  # the same fp32 values as logits(fp32=True)


def _put(side, row_ix: torch.Tensor, columns: torch.Tensor, x: torch.Tensor) -> None:
    """side (rows, G, T, hd)[row_ix, :, columns] = x (r, S, G, hd); an fp8 side (Fp8KV) gets x's
    codes and scales (its codes through a uint8 view: no float8 index_put on CPU)."""
    if isinstance(side, Fp8KV):
        codes, scale = quantize_kv(x)
        side.codes.view(torch.uint8)[row_ix, :, columns] = codes.view(torch.uint8)
        side.scale[row_ix, :, columns] = scale
    else:
        side[row_ix, :, columns] = x


def _rows(side, r: int, L: int, rows: Optional[torch.Tensor]):
    """The attended part of a cache side: rows 0..r-1 over columns 0..L-1 (a view), or `rows`."""
    if rows is None:
        return side[:r, :, :L]
    if isinstance(side, Fp8KV):
        return Fp8KV(side.codes.view(torch.uint8).index_select(0, rows).view(side.codes.dtype),
                     side.scale.index_select(0, rows))
    return side.index_select(0, rows)


class DecodeState:
    """Static tensors of one chunk of B rows over a cache of T columns and a vocabulary of V."""

    READY, FORCED, FORCED_TOKEN, ROLLBACK = range(4)  # the rows of `ctrl`
    CTRL_ROWS = 4

    def __init__(self, rows: int, length: int, vocab: int, device,
                 dtype: torch.dtype = torch.float32):
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
        # (B, V) each row's next-token logits, in `dtype` (the generator's: the decoder's logits
        # are that dtype's values, fp32 ones too, so holding them in it rounds nothing)
        self.logits = z(rows, vocab, dt=dtype)
        self.col, self.pos = z(rows), z(rows)  # (B,) next cache column, next position
        self.key_valid = z(rows, length, dt=torch.bool)  # (B, T) the columns a row attends to
        # (4, B) written by the host before each step: ready (1: sample and feed the row),
        # forced (1: emit FORCED_TOKEN instead of the draw), the forced token, rollback (1: first
        # take back the row's last fed token: rollout.multi_turn.lookahead fed it one step past
        # its call)
        self.ctrl = z(self.CTRL_ROWS, rows)
        self.out = z(2, rows, dt=torch.float64)  # (2, B) the step's token and its log-prob
        # on a GPU: the pinned buffers of the per-step copies (made at the first launch)
        self.copies: Optional[StepCopies] = None

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


class StepCopies:
    """A decode state's per-step host copies on a GPU: its control rows (host -> device) and its
    output row (device -> host) go through pinned buffers, DEPTH of each used in turn, with
    non-blocking copies. A copy from pageable memory would synchronize the stream (under
    rollout.multi_turn.lookahead: wait for the step in flight), and a pinned buffer allocated per
    step costs the caching host allocator's bookkeeping every step.

    Launch j uses pair j % DEPTH, which launch j + DEPTH rewrites. Safe because the decode loop
    reads launch j (multi_turn._read: waits for j's event, recorded on the stream after j's control
    copy, replay and output copy, and takes its tokens out of the output buffer by copies) before
    it launches j + 2: with lookahead a launch is read in the loop's next iteration, which
    launches at most j + 1; without, in its own. So when j + 2 rewrites the pinned control rows
    their copy to the device has run, and its output copy lands in a buffer the host has read.
    `launch` synchronizes the pair's last event before rewriting anyway (complete by then: no
    wait), so the device side of that ordering is checked, not assumed."""

    DEPTH = 2

    def __init__(self, st: "DecodeState"):
        pin = lambda t: torch.zeros(t.shape, dtype=t.dtype, pin_memory=True)  # noqa: E731
        self.ctrl = [pin(st.ctrl) for _ in range(self.DEPTH)]
        self.ctrl_np = [c.numpy() for c in self.ctrl]
        self.out = [pin(st.out) for _ in range(self.DEPTH)]
        self.events: list = [None] * self.DEPTH
        self.next = 0

    def launch(self, st: "DecodeState", ctrl: np.ndarray, step) -> tuple:
        """Copy `ctrl` to st.ctrl, run `step` (a replay), copy st.out back, none waited for ->
        (the pinned output, the event after which it is there)."""
        i = self.next
        self.next = (i + 1) % self.DEPTH
        if self.events[i] is not None:
            self.events[i].synchronize()
        self.ctrl_np[i][...] = ctrl
        st.ctrl.copy_(self.ctrl[i], non_blocking=True)
        step()
        out = self.out[i].copy_(st.out, non_blocking=True)
        self.events[i] = event = torch.cuda.Event()
        event.record()
        return out, event


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
        self.epoch = z()  # bumped whenever the row stops decoding (lookahead drops its next token)

    def text_ids(self, b: int, start: int) -> list:
        return self.tokens[b, start:self.n[b]].tolist()


class Slots:
    """Where the chunk's rows sit in the current decode state: compaction moves the rows that are
    not finished (decoding or waiting for a tool) into a smaller state's first slots."""

    def __init__(self, B: int, step):
        self.st, self.fns = step
        self.of = np.arange(B)  # (B,) chunk row -> its slot (-1: dropped, finished)
        self.ctrl = np.zeros((DecodeState.CTRL_ROWS, B), dtype=np.int64)

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
        self.st, self.fns, self.ctrl = st, fns, np.zeros((DecodeState.CTRL_ROWS, size),
                                                        dtype=np.int64)


def decode_step(gen, st: DecodeState, cfg: RolloutConfig, *, graphed: bool,
                kv_len: Optional[int] = None,
                opts: DecodeOptions = DecodeOptions(kernels="torch"), rollback: bool = False):
    """The step over `st` on `gen`'s weights, cache and generator, attending over the first
    `kv_len` cache columns (None: all; the caller keeps every row's next column below it):
    captured (graphed, CUDA) or the plain function. `opts` (resolved): kernels "triton" feeds the
    rows through decoder.decode_step's fused layers (a column per row), "torch" through `extend`;
    the sampler is the single-turn step's call either way (opts.kernels, opts.pdl, compiled with
    opts.compile). `rollback`: the step first takes back the last fed token of the rows whose
    ROLLBACK control is 1 (their column and position back by one, that column no longer valid),
    as rollout.multi_turn.lookahead needs. The capture's warm-up runs feed no row (ctrl is zero)
    but draw from the generator: seed it after."""
    w, cache, (cos, sin) = gen.w, gen._cache, gen._tables
    if opts.kernels not in ("torch", "triton"):
        raise ValueError(f"decode_step needs resolved DecodeOptions (kernels torch or triton), "
                         f"got kernels={opts.kernels!r}")
    fused = opts.kernels == "triton"
    scratch = (kv_len or cache.length) - 1  # the column non-ready rows write to, never valid

    def step():
        ctrl = st.ctrl
        if rollback:  # a no-op for the other rows (their column's validity written back as is)
            back = ctrl[DecodeState.ROLLBACK]
            st.col.sub_(back)
            st.pos.sub_(back)
            col = st.col[:, None]
            st.key_valid.scatter_(1, col, st.key_valid.gather(1, col) & (back == 0)[:, None])
        tok, lp = sample(st.logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                         generator=gen._rng, need_logprobs=True, kernels=opts.kernels,
                         pdl=opts.pdl, rng_state=gen.sampler_stream(opts),
                         compile_backend=opts.compile_backend if opts.compile else None,
                         replace=(ctrl[DecodeState.FORCED].bool(),
                                  ctrl[DecodeState.FORCED_TOKEN]))
        st.out[0].copy_(tok)
        st.out[1].copy_(lp)
        ready = ctrl[DecodeState.READY]
        if fused:  # row b at its own column, the non-ready rows at the scratch column
            cur = torch.where(ready.bool(), st.col, scratch)
            # own columns: a row's tokens are columns col - pos .. col - 1 (left-padded prompt,
            # then every fed or appended token at the next column); a row not fed reads none
            # (its logits are rewritten before it is sampled again)
            st.logits.copy_(decoder.decode_step(
                w, tok, st.pos, cur, st.key_valid, cache=cache, cos_tab=cos, sin_tab=sin,
                kv_len=kv_len, opts=opts, mark=ready,
                finished=(ready == 0) if opts.own_columns_only else None))
        else:
            extend(w, tok[:, None], st.pos[:, None], ready.bool()[:, None], st.col, cache=cache,
                   key_valid=st.key_valid, cos_tab=cos, sin_tab=sin, out=st.logits,
                   kv_len=kv_len)
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
