"""The multi-turn loop as it was before its decode step became one graph-capturable function: an
eager `extend` of one token per row, a host read of every sampled token and a Python pass over the
ready rows, a call's closing token appended with its results. tests/unit/test_multi_turn_step.py
checks that the graph-ready loop (rollout/multi_turn.py) gives the same tokens, log-probs and cache.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Optional

import torch
import torch.distributed as dist

from hybridflow.config import RolloutConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.rollout import decoder
from hybridflow.rollout.generator import LENGTH_MULTIPLE, Generator
from hybridflow.rollout.multi_turn import TAIL_TOKENS, extend
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.sampling import sample
from hybridflow.tools.base import ToolCall
from hybridflow.tools.runner import ToolRunner


class _Row:
    __slots__ = ("tokens", "tool", "logprobs", "n_model", "turn_start", "turns", "calls",
                 "errors", "timeouts", "state")

    def __init__(self):
        self.tokens, self.tool, self.logprobs = [], [], []
        self.n_model = 0  # the model's own tokens in `tokens`
        self.turn_start = 0  # index in tokens where the current model turn began
        self.turns, self.calls, self.errors, self.timeouts = 1, 0, 0, 0
        self.state = "decode"  # decode | tool | done


def reference_multi_turn(gen: Generator, prompts: list, *, cfg: RolloutConfig,
                        runner: ToolRunner, eos_id: int, pad_id: int, seed: int,
                        options: Optional[DecodeOptions] = None,
                        forced: Optional[list] = None) -> tuple[RolloutBatch, dict]:
    """`cfg.n` multi-turn trajectories per prompt (rows as Generator.generate orders them) ->
    (RolloutBatch with tool_mask, metrics). Of `options` (None: DecodeOptions.from_config(cfg))
    only prefill_tokens applies: the padded tokens of one prefill, of prompts or of appended tool
    results (bounds the attention scores when many rows resume at once). `forced`: per row, model
    tokens to emit in place of samples while they last (their log-probs are still the model's):
    replays and tests."""
    budget = (options or DecodeOptions.from_config(cfg)).prefill_tokens
    stats = {"tool_wait": 0.0, "tool_prefill": 0.0, "loop": 0.0}
    rows_all: list = []
    valid_all: list = []  # each chunk's cache columns the rows attend to, (B, T)
    N = len(prompts) * cfg.n
    with torch.no_grad():
        gen._rng.manual_seed(seed)
        for s in range(0, N, cfg.max_batch_size):
            e = min(s + cfg.max_batch_size, N)
            chunk = [prompts[i // cfg.n] for i in range(s, e)]
            rows, key_valid = _run_chunk(gen, chunk, cfg, runner, eos_id, pad_id, stats, budget,
                                         None if forced is None else forced[s:e])
            rows_all += rows
            valid_all.append(key_valid)
    ids, mask = gen._padded_prompts(prompts, cfg, pad_id)
    prompt_of_row = torch.arange(len(prompts)).repeat_interleave(cfg.n)
    width = max(1, max(len(r.tokens) for r in rows_all))
    resp = torch.full((N, width), pad_id, dtype=torch.long)
    rmask, tmask = torch.zeros(N, width, dtype=torch.long), torch.zeros(N, width, dtype=torch.long)
    lps = torch.zeros(N, width)
    for i, row in enumerate(rows_all):
        n = len(row.tokens)
        resp[i, :n] = torch.tensor(row.tokens, dtype=torch.long)
        rmask[i, :n] = 1
        tmask[i, :n] = torch.tensor(row.tool, dtype=torch.long)
        lps[i, :n] = torch.tensor(row.logprobs)
    batch = RolloutBatch(prompt_ids=ids.index_select(0, prompt_of_row),
                         prompt_mask=mask.index_select(0, prompt_of_row), response_ids=resp,
                         response_mask=rmask, group_ids=prompt_of_row,
                         indices=prompt_of_row.clone(),
                         rollout_logprobs=lps if cfg.return_logprobs else None, tool_mask=tmask)
    turns = torch.tensor([float(r.turns) for r in rows_all])
    calls = torch.tensor([float(r.calls) for r in rows_all])
    metrics = {"num_turns/mean": float(turns.mean()), "num_turns/max": float(turns.max()),
               "tool_calls/mean": float(calls.mean()),
               "tool_errors/mean": sum(r.errors for r in rows_all) / N,
               "tool_timeouts/mean": sum(r.timeouts for r in rows_all) / N,
               "timing_s/tool_wait": stats["tool_wait"],
               "timing_s/tool_prefill": stats["tool_prefill"],
               # the rest of the loop: sampling, decode steps, the per-step host work
               "timing_s/multi_turn_decode": stats["loop"] - stats["tool_wait"]
               - stats["tool_prefill"]}
    return batch.to(gen.device), metrics, valid_all


def _run_chunk(gen: Generator, prompts: list, cfg: RolloutConfig, runner: ToolRunner,
               eos_id: int, pad_id: int, stats: dict, budget: int,
               forced: Optional[list]) -> list:
    w, dev, tok, mt = gen.w, gen.device, runner.tok, runner.mt
    one = RolloutConfig(n=1, max_new_tokens=cfg.max_new_tokens, max_batch_size=len(prompts))
    ids, mask = gen._padded_prompts(prompts, one, pad_id)
    B, P = ids.shape
    R = cfg.max_new_tokens
    T = -(-(P + R + 1) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE  # + the scratch column
    if P + R > gen.cfg.max_position_embeddings:
        raise ValueError(f"longest prompt {P} + rollout.max_new_tokens={R} exceeds model."
                         f"max_position_embeddings={gen.cfg.max_position_embeddings}")
    gen._ensure_cache(rows=B, length=T)
    cache, (cos, sin) = gen._cache, gen._tables
    T = cache.length
    ids, mask = ids.to(dev), mask.to(dev)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    per = max(1, budget // P)
    logits = torch.cat([decoder.forward(w, ids[r:r + per], positions[r:r + per],
                                        mask[r:r + per].bool(), cos_tab=cos, sin_tab=sin,
                                        cache=cache, cache_row0=r, last_only=True)
                        for r in range(0, B, per)])  # (B, V)
    key_valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
    key_valid[:, :P] = mask.bool()
    col = torch.full((B,), P, dtype=torch.long, device=dev)  # each row's next cache column
    pos = mask.sum(1)  # each row's next position
    rows = [_Row() for _ in range(B)]
    stop_ids = {eos_id, *cfg.stop_token_ids}
    # TP_g > 1: the group's rank 0 runs the tools and decides which results are in each step; the
    # others take its outcomes (the same tokens, so the same extend calls and collectives)
    group = w.group if w.dims.tp_size > 1 else None
    leader = group is None or dist.get_rank(group) == 0
    pending: dict = {}  # row -> Future of its turn's outcomes (None off the leader)
    ready = list(range(B))  # rows whose next-token logits are in `logits`
    while True:
        t0 = time.perf_counter()
        feed = []  # rows that sampled a token to run through the next decode step
        if ready:
            tok_d, lp_d = sample(logits, temperature=cfg.temperature, top_k=cfg.top_k,
                                 top_p=cfg.top_p, generator=gen._rng, need_logprobs=True)
            toks = tok_d.tolist()
            lps = lp_d.tolist()
            for b in ready:
                row = rows[b]
                t = toks[b]
                if forced is not None and row.n_model < len(forced[b]):
                    t = forced[b][row.n_model]
                    lps[b] = float(torch.log_softmax(
                        logits[b].float() / (cfg.temperature or 1.0), -1)[t])
                row.tokens.append(t)
                row.tool.append(0)
                row.n_model += 1
                row.logprobs.append(lps[b])
                if t in stop_ids or len(row.tokens) >= R:
                    row.state = "done"
                    continue
                calls = _turn_calls(row, runner, tok)
                if calls is None:
                    feed.append(b)
                elif row.turns >= mt.max_assistant_turns:
                    row.state = "done"  # a call in the last allowed turn ends the row
                else:
                    row.state = "tool"
                    row.calls += sum(isinstance(c, ToolCall) for c in calls)
                    pending[b] = runner.submit(calls) if leader else None
        # results that are in; block for one only when nothing can decode
        resumed = _collect(pending, rows, block=not feed and bool(pending), stats=stats,
                           group=group, leader=leader)
        new_logits = {}
        if resumed:
            tp = time.perf_counter()
            new_logits = _append_results(resumed, rows, runner, R, budget, w, cache, key_valid,
                                         col, pos, cos, sin, dev)
            stats["tool_prefill"] += time.perf_counter() - tp
        if feed:
            fb = torch.tensor(feed, device=dev)
            ids1 = torch.zeros(B, 1, dtype=torch.long, device=dev)
            valid1 = torch.zeros(B, 1, dtype=torch.bool, device=dev)
            ids1[fb, 0] = torch.tensor([rows[b].tokens[-1] for b in feed], device=dev)
            valid1[fb, 0] = True
            logits = extend(w, ids1, pos[:, None], valid1, col, cache=cache,
                            key_valid=key_valid, cos_tab=cos, sin_tab=sin)
            col[fb] += 1
            pos[fb] += 1
        for b, lg in new_logits.items():
            logits[b] = lg
        ready = feed + list(new_logits)
        stats["loop"] += time.perf_counter() - t0
        if not ready and not pending:
            return rows, key_valid


def _turn_calls(row: _Row, runner: ToolRunner, tok) -> Optional[list]:
    """The calls that end the row's current model turn, or None (no complete call yet)."""
    tail = tok.decode(row.tokens[max(row.turn_start, len(row.tokens) - TAIL_TOKENS):],
                      skip_special_tokens=False)
    if not runner.fmt.ends_with_call(tail):
        return None
    text = tok.decode(row.tokens[row.turn_start:], skip_special_tokens=False)
    return runner.fmt.parse(text)


def _collect(pending: dict, rows: list, *, block: bool, stats: dict, group=None,
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
        rows[b].errors += sum(o.error for o in outcomes)
        rows[b].timeouts += sum(o.timeout for o in outcomes)
    return done


def _append_results(resumed: dict, rows: list, runner: ToolRunner, R: int, budget: int, w,
                    cache, key_valid, col, pos, cos, sin, dev) -> dict:
    """Append each resumed row's last model token (the call's end, sampled but not yet in the
    cache) and its rendered results (cut to max_tool_response_length tokens and to the response
    budget) to its cache by `extend` over those rows (sub-batches of at most `budget`
    padded tokens) -> {row: next logits}."""
    mt, tok = runner.mt, runner.tok
    appended = {}
    for b, outcomes in resumed.items():
        row = rows[b]
        ids = tok.encode(runner.fmt.render(outcomes))
        if len(ids) > mt.max_tool_response_length:
            ids = ids[:mt.max_tool_response_length]
        room = R - len(row.tokens)
        if len(ids) >= room:  # no room left for a model token after it: the row ends here
            ids = ids[:room]
            row.state = "done"
        row.tokens += ids
        row.tool += [1] * len(ids)
        row.logprobs += [0.0] * len(ids)
        if row.state == "done" or not ids:
            row.state = "done"
            continue
        row.state, row.turns = "decode", row.turns + 1
        row.turn_start = len(row.tokens)
        # the call's closing token was sampled, never fed: it goes first, then the results
        appended[b] = [row.tokens[-len(ids) - 1], *ids]
    if not appended:
        return {}
    out, batch, longest = {}, [], 0
    for b in sorted(appended, key=lambda b: len(appended[b])):  # sub-batches of similar lengths
        n = len(appended[b])
        if batch and (len(batch) + 1) * max(longest, n) > budget:
            out.update(_extend_rows(batch, appended, w, cache, key_valid, col, pos, cos, sin, dev))
            batch, longest = [], 0
        batch.append(b)
        longest = max(longest, n)
    out.update(_extend_rows(batch, appended, w, cache, key_valid, col, pos, cos, sin, dev))
    return out


def _extend_rows(order: list, appended: dict, w, cache, key_valid, col, pos, cos, sin,
                 dev) -> dict:
    """One `extend` of rows `order` by their `appended` tokens (right-padded) -> {row: logits}."""
    S = max(len(appended[b]) for b in order)
    r = len(order)
    ids_t = torch.zeros(r, S, dtype=torch.long)
    valid = torch.zeros(r, S, dtype=torch.bool)
    for i, b in enumerate(order):
        ids_t[i, :len(appended[b])] = torch.tensor(appended[b])
        valid[i, :len(appended[b])] = True
    ids_t, valid = ids_t.to(dev), valid.to(dev)
    rows_t = torch.tensor(order, device=dev)
    steps = torch.arange(S, device=dev)[None]
    logits = extend(w, ids_t, pos[rows_t][:, None] + steps, valid, col[rows_t], cache=cache,
                    key_valid=key_valid, cos_tab=cos, sin_tab=sin, rows=rows_t)
    lens = valid.sum(1)
    col[rows_t] += lens
    pos[rows_t] += lens
    return {b: logits[i] for i, b in enumerate(order)}
