"""Multi-turn generation with tool calls, in place on the generator's KV cache.

    runner = ToolRunner(tools, fmt=ToolFormat("hermes", tokenizer=tok, tools=tools),
                          tokenizer=tok, mt=cfg.rollout.multi_turn)
    batch, stats = generate_multi_turn(gen, prompts, cfg=cfg.rollout, runner=runner,
                                       eos_id=tok.eos_id, pad_id=tok.pad_id, seed=seed)

A layer around the Generator's weights, cache and sampler (generator.py is unchanged). Per chunk of
at most rollout.max_batch_size rows:
- Prefill: `decoder.forward` over the left-padded prompts into cache columns 0..P-1, once per
  distinct prompt of the chunk, copied to the rows of its rollout.n samples (as single-turn).
- Every row owns its next cache column (`col`) and position (`pos`): rows at different turns share
  one batch, each writing its own columns. `extend` (below) is the one step function: it runs S new
  tokens per row at those columns/positions, attending to the row's valid cache columns plus the
  new tokens causally. A decode step (multi_turn_step.py) draws every row's token and feeds one
  token for every row of the chunk (rows that are not decoding - waiting for a tool or finished -
  write their K/V into a scratch column, never marked valid) over static state: on a GPU it is one CUDA-graph replay (rollout.cuda_graphs), per KV
  window with rollout.decode_kv_window. Appending a tool result is an eager `extend` of its
  tokens for the resumed rows only (a short prefill at the rows' next positions, no re-sending of
  the conversation), in place on the same state, which also gives their next token's logits.
- Host work per step: one device-to-host copy of the drawn tokens and log-probs, the rows'
  bookkeeping as numpy array ops, and the turn's text decoded only for rows whose new token can
  close a call (ToolRunner.close_tokens: its text holds the marker's last character).
- Compaction (rollout.compact_finished_rows): when the rows not finished (decoding or waiting for
  a tool) fit in half the current state, they move into a smaller one (compaction.py's ladder and
  threshold; their logits, columns, positions, valid columns and cache rows), with its own
  captured steps; the host maps chunk rows to slots. Decisions use host-known states, so every
  TP_g rank takes the same ones. Greedy output is unchanged; a sampled one draws from a stream of
  another batch size (seeded-reproducible, as single-turn's).
- A row whose turn ends in a complete call (`ToolFormat`: `</tool_call>`, or a closing ``` fence
  of a ```python block; the step fed that closing token already) pauses; its calls go to a
  thread pool (ToolRunner) and the other rows keep decoding; results are polled between steps
  (and waited for only when no row can decode and none is held). Results that are in are held
  and appended together (an append is a forward pass whatever its rows, and a process-backed
  tool's results trickle in one or two per step), at the latest
  rollout.multi_turn.append_wait_steps decode steps after the oldest came in, as soon as
  append_batch_rows rows hold one, or when no row could decode otherwise (0 steps: each poll's
  results at once). With rollout.multi_turn.append=decode a result is not appended by `extend`
  at all: its tokens go to the row's queue and the decode step feeds them one per step as forced
  tokens (recorded as tool tokens, log-prob 0; no stop or call check on them), which costs no
  forward pass of its own (the step computes every slot anyway) but delays the row by as many
  steps as the result has tokens. With rollout.multi_turn.lookahead (append=decode only) each
  step is launched before the previous one's tokens are read, so the host's bookkeeping overlaps
  the device's step (on a GPU the control rows go up and the tokens come back through pinned
  buffers by non-blocking copies, multi_turn_step.StepCopies: neither waits for the step in
  flight); a row that stopped or called
  a tool at step k was fed once more at k + 1: that token is dropped (`Rows.epoch`) and, after a
  call, taken back in the cache by the next step (DecodeState.ROLLBACK). At TP_g > 1 only the
  generation group's rank 0 runs tools; it broadcasts
  which results are in and what they are at each poll, and the holding decides on step counts
  and those broadcasts only (never wall time), so every rank appends the same tokens at the
  same step.
- Limits: rollout.multi_turn.max_assistant_turns model turns per row (a call in the last one ends
  the row), a tool result cut to max_tool_response_length tokens, and rollout.max_new_tokens for
  the whole response (model and tool tokens together; a result that does not fit is cut and ends
  the row). Stop at EOS / rollout.stop_token_ids as single-turn.
- Seeded sampling is reproducible as far as the tools' timing is: the poll at which a result
  comes in depends on when the call finished (every row samples from one stream); holding
  moves its append later by a number of steps fixed by the polls' outcomes. Greedy output does
  not depend on when a result is appended.
Output: a RolloutBatch whose response holds every turn and tool result, response_mask 1 over all
of it (the context the trainer's forward sees), tool_mask 1 on the tool results' tokens (the loss,
KL and advantages skip them: RolloutBatch.loss_mask), and rollout_logprobs 0 on tool tokens.
The decode step runs the single-turn step's layers on plain weights: with rollout.decode_kernels
triton (auto on a GPU) decoder.decode_step's fused Triton layers with a cache column per row, with
torch `extend` (multi_turn_step.py); not compiled or quantized layers
(config_checks.validate_multi_turn refuses those when set). The prefill and the appends are
`decoder.forward` / `extend` (PyTorch ops). The math is decoder.forward's, so the cache after any
number of turns equals a from-scratch prefill of the whole conversation
(tests/unit/test_multi_turn.py); the fused step gives the torch step's tokens
(tests/unit/test_multi_turn_fused.py); graphed equals eager (tests/gpu/test_multi_turn_gpu.py).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.config import RolloutConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.rollout import compaction, decoder
from hybridflow.rollout.cuda_graph import bucket_sizes
from hybridflow.rollout.generator import (LENGTH_MULTIPLE, Generator, kv_windows, round_up,
                                          window_for)
from hybridflow.rollout.multi_turn_step import (DecodeState, Rows, Slots, StepCopies,  # noqa: F401
                                               decode_step, extend)
from hybridflow.rollout.options import DecodeOptions
from hybridflow.tools.base import ToolCall
from hybridflow.tools.runner import ToolRunner

TAIL_TOKENS = 8  # a turn's last tokens decoded each step to spot a closing marker


def generate_multi_turn(gen: Generator, prompts: list, *, cfg: RolloutConfig,
                        runner: ToolRunner, eos_id: int, pad_id: int, seed: int,
                        options: Optional[DecodeOptions] = None,
                        forced: Optional[list] = None) -> tuple[RolloutBatch, dict]:
    """`cfg.n` multi-turn trajectories per prompt (rows as Generator.generate orders them) ->
    (RolloutBatch with tool_mask, metrics). Of `options` (None: DecodeOptions.from_config(cfg))
    these apply: kernels (resolved as Generator.generate does: "auto" is triton on a GPU, torch
    for MoE; the decode step's layers and sampler, multi_turn_step.py), pdl and the other kernel
    launch options, compile (the sampler only), prefill_tokens (the padded tokens of one
    prefill, of prompts or of appended tool results: bounds the attention scores when many rows
    resume at once), cuda_graphs (on a GPU the decode step is a CUDA-graph replay per state size
    and window), kv_window, compact_finished_rows, min_graphed_bucket (compaction.py) and
    emulate_graphs. `forced`: per row, model tokens to emit in place of samples while they last
    (their log-probs are still the model's): replays and tests."""
    opts = options or DecodeOptions.from_config(cfg)
    if gen.cfg.moe.enabled and opts.kernels == "auto":  # the Triton layers are dense-only
        opts = opts.replace(kernels="torch")
    opts = opts.resolved(gen.device, gen.w.dims.head_dim)
    gen._check_options(opts)
    stats = {"tool_wait": 0.0, "tool_prefill": 0.0, "loop": 0.0, "decode_steps": 0,
             "window_steps": {}, "row_steps": 0, "compactions": 0, "append_calls": 0,
             "append_rows": 0, "fed_tokens": 0, "step_wait": 0.0, "dropped": 0}
    N, R = len(prompts) * cfg.n, cfg.max_new_tokens
    ids, mask = gen._padded_prompts(prompts, cfg, pad_id)  # checks prompts and cfg
    P = ids.shape[1]
    if P + R > gen.cfg.max_position_embeddings:
        raise ValueError(f"longest prompt {P} + rollout.max_new_tokens={R} exceeds model."
                         f"max_position_embeddings={gen.cfg.max_position_embeddings}")
    chunks = [(s, min(s + cfg.max_batch_size, N)) for s in range(0, N, cfg.max_batch_size)]
    # + the scratch column; lookahead: + the column of the token a full row is fed once more
    T = round_up(P + R + 1 + runner.mt.lookahead_on, LENGTH_MULTIPLE)
    with torch.no_grad():
        gen._ensure_cache(rows=max(e - s for s, e in chunks), length=T,
                          fp8=cfg.kv_cache_dtype == "fp8")
        # emulate_graphs: the graphed path's states, ladder and warm-ups off a GPU (tests)
        graphed = opts.cuda_graphs and (gen.device.type == "cuda" or opts.emulate_graphs)
        # every chunk size's step before seeding: a capture's warm-up runs draw from the stream
        windows = kv_windows(gen._cache.length, opts.kv_window)
        targets = {e - s: _targets(e - s, opts, graphed) for s, e in chunks}
        sizes = {b for s, e in chunks for b in (e - s, *targets[e - s])}
        steps = {b: _step(gen, b, cfg, graphed, windows, opts, runner.mt.lookahead_on)
                 for b in sorted(sizes, reverse=True)}
        gen.reseed(seed)
        hosts = []
        for s, e in chunks:
            # rows s..e-1 are copies of prompts lo..hi-1: each prefilled once
            lo, hi = s // cfg.n, (e - 1) // cfg.n + 1
            copy_of = torch.arange(s, e) // cfg.n - lo
            hosts.append(_run_chunk(gen, prompts[lo:hi], copy_of, cfg, runner, eos_id, pad_id,
                                    stats, opts.prefill_tokens,
                                    None if forced is None else forced[s:e], steps,
                                    targets[e - s]))
    prompt_of_row = torch.arange(len(prompts)).repeat_interleave(cfg.n)
    n = np.concatenate([h.n for h in hosts])
    width = max(1, int(n.max()))
    cat = lambda name: torch.from_numpy(  # noqa: E731
        np.concatenate([getattr(h, name)[:, :width] for h in hosts]))
    rmask = (torch.arange(width)[None] < torch.from_numpy(n)[:, None]).long()
    resp = cat("tokens").masked_fill(rmask == 0, pad_id)
    batch = RolloutBatch(prompt_ids=ids.index_select(0, prompt_of_row),
                         prompt_mask=mask.index_select(0, prompt_of_row), response_ids=resp,
                         response_mask=rmask, group_ids=prompt_of_row,
                         indices=prompt_of_row.clone(),
                         rollout_logprobs=cat("logprobs") if cfg.return_logprobs else None,
                         tool_mask=cat("tool"))
    per_row = lambda name: np.concatenate([getattr(h, name) for h in hosts]).astype(float)  # noqa
    turns = per_row("turns")
    metrics = {"num_turns/mean": float(turns.mean()), "num_turns/max": float(turns.max()),
               "tool_calls/mean": float(per_row("calls").mean()),
               "tool_errors/mean": float(per_row("errors").mean()),
               "tool_timeouts/mean": float(per_row("timeouts").mean()),
               "timing_s/tool_wait": stats["tool_wait"],
               "timing_s/tool_prefill": stats["tool_prefill"],
               # the rest of the loop: sampling, decode steps, the per-step host work
               "timing_s/multi_turn_decode": stats["loop"] - stats["tool_wait"]
               - stats["tool_prefill"],
               # of which launching each decode step and waiting for its tokens (the device's
               # time, with any work queued before it), and the host's own work between steps
               "timing_s/multi_turn_step_wait": stats["step_wait"],
               "timing_s/multi_turn_host": stats["loop"] - stats["tool_wait"]
               - stats["tool_prefill"] - stats["step_wait"],
               "multi_turn/decode_steps": float(stats["decode_steps"]),
               # rows the decode steps computed (rollout.compact_finished_rows drops finished ones)
               "multi_turn/decode_row_steps": float(stats["row_steps"]),
               "multi_turn/compactions": float(stats["compactions"]),
               # eager extend calls appending tool results, and the rows each appended on average
               # (rollout.multi_turn.append_wait_steps / append_batch_rows hold results for fewer,
               # larger calls)
               "multi_turn/append_calls": float(stats["append_calls"]),
               "multi_turn/append_rows_mean": stats["append_rows"]
               / max(1, stats["append_calls"]),
               # tool-result tokens fed through the decode step (rollout.multi_turn.append=decode)
               "multi_turn/fed_tool_tokens": float(stats["fed_tokens"]),
               # tokens lookahead's steps drew for rows that had stopped or called a tool
               "multi_turn/lookahead_dropped": float(stats["dropped"]),
               # cache columns a decode step attended over, on average (rollout.decode_kv_window)
               "multi_turn/kv_columns_mean": sum((k or gen._cache.length) * v for k, v in
                                                 stats["window_steps"].items())
               / max(1, stats["decode_steps"])}
    return batch.to(gen.device), metrics


def _targets(B: int, opts: DecodeOptions, graphed: bool) -> list:
    """The smaller states a chunk of B rows compacts into (compaction.py's ladder: powers of two,
    under CUDA graphs at least opts.min_graphed_bucket rows), ascending; [] without compaction."""
    if not opts.compact_finished_rows:
        return []
    return [b for b in compaction.ladder(bucket_sizes(B), graphed=graphed,
                                         min_graphed=opts.min_graphed_bucket) if b < B]


def _step(gen: Generator, B: int, cfg: RolloutConfig, graphed: bool, windows: list,
          opts: DecodeOptions, rollback: bool = False):
    """(DecodeState, {kv_len: step}) of chunks of B rows, kept on the generator per `opts`
    (resolved; its release() drops them with the other captured steps; a cache that grows
    releases them too); `rollback`: steps that can take back a row's last token (lookahead)."""
    key = ("multi_turn", B, gen._cache.length, cfg.temperature, cfg.top_k, cfg.top_p, graphed,
           tuple(windows), opts, rollback)
    if key not in gen._steps:
        st = DecodeState(B, gen._cache.length, gen.w.dims.true_vocab, gen.device, gen.dtype)
        gen._steps[key] = (st, {kv_len: decode_step(gen, st, cfg, graphed=graphed, kv_len=kv_len,
                                                    opts=opts, rollback=rollback)
                                for kv_len in windows})
    return gen._steps[key]


def _run_chunk(gen: Generator, prompts: list, copy_of: torch.Tensor, cfg: RolloutConfig,
               runner: ToolRunner, eos_id: int, pad_id: int, stats: dict, budget: int,
               forced: Optional[list], steps: dict, targets: list) -> Rows:
    """Prefill the chunk's distinct `prompts`, then decode its B = len(copy_of) rows to the end
    (compacting into the `targets` sizes of `steps`) -> their host record."""
    w, tok, mt, cache = gen.w, runner.tok, runner.mt, gen._cache
    B, R = len(copy_of), cfg.max_new_tokens
    P = _prefill(gen, prompts, copy_of, steps[B][0], pad_id=pad_id, budget=budget)
    rows, slots = Rows(B, R), Slots(B, steps[B])
    may_close = runner.close_tokens(w.dims.true_vocab)  # (V,) bool
    is_stop = np.zeros(len(may_close), dtype=bool)  # (V,) bool: a lookup, not np.isin per step
    stop_ids = np.array([eos_id, *cfg.stop_token_ids], dtype=np.int64)
    is_stop[stop_ids[(stop_ids >= 0) & (stop_ids < len(may_close))]] = True
    if forced is not None:  # (B, longest) tokens, their counts
        f_len = np.array([len(f) for f in forced], dtype=np.int64)
        f_tok = np.zeros((B, max(1, int(f_len.max()))), dtype=np.int64)
        for b, f in enumerate(forced):
            f_tok[b, :len(f)] = f
        forced = (f_tok, f_len)
    # TP_g > 1: the group's rank 0 runs the tools and decides which results are in each step; the
    # others take its outcomes (the same tokens, so the same extend calls and collectives)
    group = w.group if w.dims.tp_size > 1 else None
    leader = group is None or dist.get_rank(group) == 0
    pending: dict = {}  # row -> Future of its turn's outcomes (None off the leader)
    held: dict = {}  # row -> (outcomes, the chunk's decode step they came in after)
    queue: dict = {}  # append "decode": row -> its result's tokens still to feed (a deque)
    ready = np.arange(B)  # rows whose next-token logits are in the decode state
    step = 0  # the chunk's decode steps so far (the same on every TP_g rank)
    # rollout.multi_turn.lookahead: the step launched before the previous one's tokens are read
    ahead = mt.lookahead_on
    flight: Optional[_Launched] = None  # (lookahead) the step launched, its tokens not yet read
    rollback = ready[:0]  # (lookahead) rows fed one token past their call: taken back next step
    while True:
        t0 = time.perf_counter()
        launched = None
        if ready.size:
            launched = _launch(slots, rows, ready, P=P, forced=forced, stats=stats, queue=queue,
                               flight=flight, rollback=rollback)
            rollback = ready[:0]
            step += 1
        todo, flight = (flight, launched) if ahead else (launched, None)
        if todo is not None:
            got, t, fed = _read(todo, rows, stats)
            # a fed tool token neither stops its row nor closes a call
            stop = (is_stop[t] & ~fed) | (rows.n[got] >= R)
            rows.state[got[stop]] = Rows.DONE
            rows.epoch[got[stop]] += 1
            for i in np.flatnonzero(~stop & may_close[t] & ~fed):  # tokens that may close a call
                b = int(got[i])
                calls = _turn_calls(rows, b, runner, tok)
                if calls is None:
                    continue
                rows.epoch[b] += 1  # the row leaves decoding: a token in flight is dropped
                if rows.turns[b] >= mt.max_assistant_turns:
                    rows.state[b] = Rows.DONE  # a call in the last allowed turn ends the row
                else:
                    rows.state[b] = Rows.TOOL
                    rows.calls[b] += sum(isinstance(c, ToolCall) for c in calls)
                    pending[b] = runner.submit(calls) if leader else None
                    if flight is not None and b in flight.ready:  # fed once more meanwhile
                        rollback = np.append(rollback, b)
        # the rows the next step samples: those of the last launch still decoding
        last = flight if flight is not None else todo
        feed = ready[:0] if last is None else last.ready[rows.state[last.ready] == Rows.DECODE]
        # results that are in (block for one only when nothing can decode, no step is in flight
        # and none is held), held until one of them has waited its steps, enough rows hold one,
        # or nothing decodes; with append "decode" each goes to its row's queue at once
        done = _collect(pending, rows, block=not feed.size and flight is None
                        and bool(pending) and not held, stats=stats, group=group, leader=leader)
        back = []
        if mt.append == "decode":
            for b, ids in _result_tokens(done, rows, runner, R).items():
                queue[b] = deque(ids)
                back.append(b)
        else:
            held.update((b, (outcomes, step)) for b, outcomes in done.items())
        if held and _flush(held, step, mt, decoding=int(feed.size)):
            tp = time.perf_counter()
            back = _append_results({b: o for b, (o, _) in held.items()}, rows, runner, R, budget,
                                   w, cache, slots, *gen._tables, gen.device, stats=stats)
            held.clear()
            stats["tool_prefill"] += time.perf_counter() - tp
        if back:  # np.union1d's sorted union by a mask (union1d hashes, slower here)
            mark = np.zeros(B, dtype=bool)
            mark[feed] = True
            mark[back] = True
            ready = np.flatnonzero(mark)
        else:
            ready = feed
        live = np.flatnonzero(rows.state != Rows.DONE)
        new_b = compaction.target_bucket(len(live), slots.size, targets) if live.size else None
        if new_b is not None:  # the rows still decoding or waiting for a tool, in fewer slots
            slots.move(live, steps[new_b], cache,
                       columns=min(cache.length, P + int(rows.n[live].max()) + 2))
            stats["compactions"] += 1
        stats["loop"] += time.perf_counter() - t0
        if not ready.size and flight is None and not pending and not held:
            return rows


def _flush(held: dict, step: int, mt, *, decoding: int) -> bool:
    """Whether the `held` results ({row: (outcomes, step they came in after)}) are appended now,
    at the chunk's decode step `step` with `decoding` rows decoding on: the oldest has waited
    mt.append_wait_steps steps, mt.append_batch_rows rows hold one, or no row decodes (never a
    step without work while results are in). Host state only: every TP_g rank decides alike."""
    oldest = min(s for _, s in held.values())
    return (not decoding or step - oldest >= mt.append_wait_steps
            or len(held) >= mt.append_batch_rows)


def _prefill(gen: Generator, prompts: list, copy_of: torch.Tensor, st: DecodeState, *,
             pad_id: int, budget: int) -> int:
    """The distinct `prompts` left-padded to P, prefilled once each (sub-batches of at most
    `budget` padded tokens) into cache rows 0..U-1, their K/V columns 0..P-1 and last logits
    copied to the rows of their copies `copy_of` (B,) (chunk row -> prompt; as
    Generator.generate); `st` reset for them -> P."""
    w, dev, (cos, sin), cache = gen.w, gen.device, gen._tables, gen._cache
    one = RolloutConfig(n=1, max_batch_size=len(prompts))
    ids, mask = gen._padded_prompts(prompts, one, pad_id)
    (U, P), B = ids.shape, len(copy_of)
    ids, mask = ids.to(dev), mask.to(dev)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    per = max(1, budget // P)
    logits = torch.cat([decoder.forward(w, ids[r:r + per], positions[r:r + per],
                                        mask[r:r + per].bool(), cos_tab=cos, sin_tab=sin,
                                        cache=cache, cache_row0=r, last_only=True)
                        for r in range(0, U, per)])  # (U, V), K/V in cache rows 0..U-1
    if U < B:  # each copy gets its prompt's K/V and logits
        copy_of = copy_of.to(dev)
        cache.gather_rows(copy_of, columns=P)
        logits, mask = logits.index_select(0, copy_of), mask.index_select(0, copy_of)
    st.reset(logits=logits, mask=mask)
    return P


class _Launched(NamedTuple):
    """A decode step launched: the chunk rows it sampled, their slots and epochs then, which of
    them it fed a tool token, its (2, slots) tokens and log-probs on the host (a copy that may
    still be in flight) and the event after which they are there (None: there already)."""
    ready: np.ndarray
    at: np.ndarray
    epoch: np.ndarray
    fed: np.ndarray
    out: torch.Tensor
    event: Optional[torch.cuda.Event]


def _launch(slots: Slots, rows: Rows, ready: np.ndarray, *, P: int, forced, stats: dict,
            queue: dict, flight: Optional[_Launched] = None,
            rollback: np.ndarray = np.zeros(0, dtype=np.int64)) -> _Launched:
    """Launch one decode step that samples (and feeds) the `ready` rows: their control row
    (forced tokens while `forced` = (tokens (B, F), counts (B,)) lasts; a row in `queue` (append
    "decode": row -> deque of its tool result's tokens) is fed the next of those instead; the
    `rollback` rows first take back their last token), the window that holds every state row's
    next column, the replay, and the copy of its tokens to the host (not waited for). `flight`:
    the step launched before, whose tokens the host has not read yet (lookahead): its rows count
    one more token."""
    ctrl, at = slots.ctrl, slots.of[ready]
    ctrl.fill(0)
    ctrl[DecodeState.READY, at] = 1
    ctrl[DecodeState.ROLLBACK, slots.of[rollback]] = 1
    more = np.zeros(len(rows.n), dtype=np.int64)  # tokens in flight per chunk row
    model = np.zeros_like(more)  # of which model tokens (not fed tool tokens)
    if flight is not None:
        live = rows.epoch[flight.ready] == flight.epoch
        more[flight.ready[live]] = 1
        model[flight.ready[live & ~flight.fed]] = 1
    if forced is not None:
        f_tok, f_len = forced
        n_model = rows.n_model[ready] + model[ready]
        on = n_model < f_len[ready]
        ctrl[DecodeState.FORCED, at[on]] = 1
        ctrl[DecodeState.FORCED_TOKEN, at[on]] = f_tok[ready[on], n_model[on]]
    fed = np.zeros(len(ready), dtype=bool)
    if queue:
        queued = np.zeros(len(rows.n), dtype=bool)
        queued[np.fromiter(queue, dtype=np.int64, count=len(queue))] = True
        fed = queued[ready]
        ctrl[DecodeState.FORCED, at[fed]] = 1
        ctrl[DecodeState.FORCED_TOKEN, at[fed]] = [_pop(queue, int(b)) for b in ready[fed]]
    # a row's next column is below P + its length (+ a token in flight) + 1: the window that holds
    # every row in the state (finished ones too, until compaction drops them: their cache stays)
    window = window_for(slots.fns, P + int((rows.n + more)[slots.of >= 0].max()) + 1)
    st = slots.st
    t0 = time.perf_counter()
    if st.out.is_cuda:  # through pinned buffers, not waited for: the step in flight runs on
        if st.copies is None:
            st.copies = StepCopies(st)
        # draws every slot's token, feeds the ready rows'
        out, event = st.copies.launch(st, ctrl, slots.fns[window])
    else:
        st.ctrl.copy_(torch.from_numpy(ctrl))
        slots.fns[window]()
        out, event = st.out.clone(), None
    stats["step_wait"] += time.perf_counter() - t0
    stats["window_steps"][window] = stats["window_steps"].get(window, 0) + 1
    stats["decode_steps"] += 1
    stats["row_steps"] += slots.size
    return _Launched(ready, at, rows.epoch[ready].copy(), fed, out, event)


def _pop(queue: dict, b: int) -> int:
    """Row b's next queued tool token (the row leaves the queue with its last)."""
    token = queue[b].popleft()
    if not queue[b]:
        del queue[b]  # its last result token is in: it samples from the next step on
    return token


def _read(f: _Launched, rows: Rows, stats: dict):
    """Wait for launched step `f`'s tokens and record them for its rows that still decode as
    they did then (a row that stopped or paused since, lookahead's, drops its token) -> (those
    rows, their tokens, which were fed tool tokens), the rows' arrays."""
    t0 = time.perf_counter()
    if f.event is not None:
        f.event.synchronize()
    out = f.out.numpy()
    stats["step_wait"] += time.perf_counter() - t0
    keep = rows.epoch[f.ready] == f.epoch
    stats["dropped"] += int((~keep).sum())
    ready, at, fed = f.ready[keep], f.at[keep], f.fed[keep]
    t = out[0, at].astype(np.int64)
    n = rows.n[ready]
    rows.tokens[ready, n] = t
    rows.logprobs[ready, n] = np.where(fed, 0.0, out[1, at])
    rows.tool[ready, n] = fed
    rows.n[ready] += 1
    rows.n_model[ready] += ~fed
    stats["fed_tokens"] += int(fed.sum())
    return ready, t, fed


def _turn_calls(rows: Rows, b: int, runner: ToolRunner, tok) -> Optional[list]:
    """The calls that end row b's current model turn, or None (no complete call yet)."""
    start = int(rows.turn_start[b])
    tail = tok.decode(rows.text_ids(b, max(start, int(rows.n[b]) - TAIL_TOKENS)),
                      skip_special_tokens=False)
    if not runner.fmt.ends_with_call(tail):
        return None
    return runner.fmt.parse(tok.decode(rows.text_ids(b, start), skip_special_tokens=False))


def _collect(pending: dict, rows: Rows, *, block: bool, stats: dict, group=None,
             leader: bool = True) -> dict:
    """{row: outcomes} of the finished calls (waiting for at least one when `block`); with a TP_g
    group, the leader's, broadcast (every rank has the same rows pending)."""
    t = time.perf_counter()
    done = {}
    if leader and pending:
        if block:
            wait(list(pending.values()), return_when=FIRST_COMPLETED)
        done = {b: f.result() for b, f in pending.items() if f.done()}
    if group is not None and pending:
        box = [done]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        done = box[0]
    if block:
        stats["tool_wait"] += time.perf_counter() - t
    for b, outcomes in done.items():
        del pending[b]
        rows.errors[b] += sum(o.error for o in outcomes)
        rows.timeouts[b] += sum(o.timeout for o in outcomes)
    return done


def _result_tokens(resumed: dict, rows: Rows, runner: ToolRunner, R: int) -> dict:
    """{row: the tokens of its rendered results (cut to max_tool_response_length and to the
    response budget)} for the resumed rows that go on, each set to decode its next turn after
    them; a row whose results leave no room for a model token gets them written here and ends."""
    mt, tok = runner.mt, runner.tok
    out = {}
    for b, outcomes in resumed.items():
        ids = tok.encode(runner.fmt.render(outcomes))[:mt.max_tool_response_length]
        n = int(rows.n[b])
        room = R - n
        ids = ids[:room]  # a result that fills the budget leaves no room for a model token
        if not ids or len(ids) >= room:
            _write_tool_tokens(rows, b, ids)
            rows.state[b] = Rows.DONE
            continue
        rows.state[b], rows.turn_start[b] = Rows.DECODE, n + len(ids)
        rows.turns[b] += 1
        out[b] = ids
    return out


def _write_tool_tokens(rows: Rows, b: int, ids: list) -> None:
    """Row b's record extended by tool-result tokens `ids` (marked as tool tokens)."""
    n = int(rows.n[b])
    rows.tokens[b, n:n + len(ids)] = ids
    rows.tool[b, n:n + len(ids)] = 1
    rows.n[b] += len(ids)


def _append_results(resumed: dict, rows: Rows, runner: ToolRunner, R: int, budget: int, w,
                    cache, slots: Slots, cos, sin, dev, *, stats: dict) -> list:
    """Append each resumed row's rendered results (`_result_tokens`) to its cache by `extend`
    over those rows (sub-batches of at most `budget` padded tokens; the call's closing token is in
    the cache already: the decode step fed it) -> the rows that decode on, their next logits in
    the decode state's."""
    appended = _result_tokens(resumed, rows, runner, R)
    for b, ids in appended.items():
        _write_tool_tokens(rows, b, ids)
    if not appended:
        return []
    batch, longest = [], 0
    for b in sorted(appended, key=lambda b: len(appended[b])):  # sub-batches of similar lengths
        n = len(appended[b])
        if batch and (len(batch) + 1) * max(longest, n) > budget:
            _extend_rows(batch, appended, w, cache, slots, cos, sin, dev, stats=stats)
            batch, longest = [], 0
        batch.append(b)
        longest = max(longest, n)
    _extend_rows(batch, appended, w, cache, slots, cos, sin, dev, stats=stats)
    return list(appended)


def _extend_rows(order: list, appended: dict, w, cache, slots: Slots, cos, sin, dev, *,
                 stats: dict) -> None:
    """One `extend` of rows `order` by their `appended` tokens (right-padded); their next logits
    go to the decode state's, their columns and positions advance (in place: the decode step's
    state, at the rows' slots). Counted in stats (append_calls, append_rows)."""
    st = slots.st
    stats["append_calls"] += 1
    stats["append_rows"] += len(order)
    S = max(len(appended[b]) for b in order)
    r = len(order)
    ids_t = torch.zeros(r, S, dtype=torch.long)
    valid = torch.zeros(r, S, dtype=torch.bool)
    for i, b in enumerate(order):
        ids_t[i, :len(appended[b])] = torch.tensor(appended[b])
        valid[i, :len(appended[b])] = True
    ids_t, valid = ids_t.to(dev), valid.to(dev)
    rows_t = torch.from_numpy(slots.of[order]).to(dev)
    steps = torch.arange(S, device=dev)[None]
    lg = extend(w, ids_t, st.pos[rows_t][:, None] + steps, valid, st.col[rows_t], cache=cache,
                key_valid=st.key_valid, cos_tab=cos, sin_tab=sin, rows=rows_t)
    # fp32 values of the weights' dtype: the state's dtype holds them exactly
    st.logits.index_copy_(0, rows_t, lg.to(st.logits.dtype))
    lens = valid.sum(1)
    st.col[rows_t] += lens
    st.pos[rows_t] += lens
