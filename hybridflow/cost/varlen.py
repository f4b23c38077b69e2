"""Variable-length work of one step, row by row: what timing.py charges when `Workload.varlen`.

Rows: N rows get the quantiles at (i + 0.5) / N of `Workload.response_lengths` (every row
response_len without it), in a fixed pseudo-random order (rows of one chunk span the distribution);
every prompt is prompt_len tokens for the training passes, and generation pads a chunk's prompts
to prompt_len_max (left padding).

Generation (`decode_schedule`), per chunk of at most gen_max_batch_size rows, as
hybridflow.rollout.generator runs it: the chunk decodes in a graph bucket of b >= B rows (the
powers of two below gen_max_batch_size, and it); token t (t = 0 is the prefill's) is one step
of all b bucket rows, every row's attention over the columns written so far (P + t; with
decode_kv_window W, over the multiple of W that holds them, at most the cache's P + cap columns
rounded up to 64; with own_columns_only, only the live rows, each over its own prompt_len + t
columns). Rows finish at their length; every CHECK_EVERY steps the live count is polled
one poll late (an upper bound), which ends the chunk once it was 0 (so a step whose longest row
ends before max_new_tokens runs up to 2 polls past it) and, with compact_finished_rows, moves the
live rows into the smallest ladder bucket (>= MIN_GRAPHED_BUCKET rows) that holds them when that
at least halves the bucket; the move copies the kept rows' K/V (read and written). So the long tail
runs at a few rows, each step still reading every weight. Partial rollouts
(`Workload.partial_decode_steps` C) are costed in their steady state: a step's call holds every
C-token segment of a step's worth of rows (`partial_segments`), a carried segment re-prefilled as
prompt + the response before it and reading those columns too, and decodes at most C steps.
The speculative tail (`Workload.spec_rows` M): from the first poll whose live count is at most M,
the running rows advance `spec_tail_tokens_per_step` tokens per step, each step M x (1 + drafts)
tokens of decode work that read every running row's own columns once (timing.py adds what a tail
step costs beyond that, SPEC_TAIL_STEP_S).

Training passes (`pass_work`): a DP rank's rows split into micro-batches as the trainer does
(hybridflow.data.microbatch.token_budget_groups under dynamic_bsz, else fixed micro-batches of
rows padded to the batch's longest row). A packed micro-batch (pack_sequences; rows of equal length
run unpacked) computes its real tokens, attention over each row's own tokens (sum of l_i^2) and the
LM head at its response tokens; an unpacked one rows x its longest prompt + response. Every
micro-batch of rows of different lengths needs an attention mask (the packed row's document mask
under flex_attention, padded rows' explicit mask under SDPA): its attention is `masked_attention`,
whose FLOPs timing.py charges again at `masked_attention_efficiency` (rows of one length run flash
attention's maskless causal kernel). A packed micro-batch on FlashAttention's varlen kernels
(`Workload.packed_attention` varlen or fa4) counts its kernel's share of that (`MASKED_SHARE`);
one the update's CUDA graphs replay (`padded_to_budget`) counts varlen's, the kernel the graphs
capture.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import numpy as np

from hybridflow.cost.workload import Workload

CHECK_EVERY = 16          # rollout DecodeOptions.check_every: steps between stop polls
MIN_GRAPHED_BUCKET = 16   # DecodeOptions.min_graphed_bucket: the smallest compaction bucket
LENGTH_MULTIPLE = 64      # generator.LENGTH_MULTIPLE: the KV cache's length rounding
PREFILL_TOKENS = 16384    # DecodeOptions.prefill_tokens: prompt tokens per prefill sub-batch


def row_lengths(w: Workload, rows: int) -> np.ndarray:
    """Response lengths of `rows` rows (int64), in the rows' order."""
    if w.response_lengths is None:
        return np.full(rows, w.response_len, dtype=np.int64)
    pts = np.asarray(w.response_lengths, dtype=np.int64)
    idx = np.minimum((np.arange(rows) + 0.5) * len(pts) / rows, len(pts) - 1).astype(np.int64)
    return np.random.default_rng(0).permutation(pts[idx])


def bucket_sizes(max_batch_size: int) -> list[int]:
    """hybridflow.rollout.cuda_graph.bucket_sizes: powers of two below the cap, and the cap."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


def below_cap(current: int) -> int | None:
    """hybridflow.rollout.compaction.below_cap: the power of two below a cap bucket that is not
    one (compaction may move there from it), else None."""
    return None if current & (current - 1) == 0 else 1 << (current.bit_length() - 1)


@dataclass(frozen=True)
class Decode:
    """One generation call's decode work on one gen replica."""
    steps: int = 0             # decode steps (tokens of the longest row, with the poll lag)
    row_steps: float = 0.0     # sum over steps of the bucket's rows
    row_columns: float = 0.0   # sum over steps of bucket rows x attended columns
    moved_bytes: float = 0.0   # K/V bytes read + written by compactions (x kv bytes per token)
    compactions: int = 0
    chunks: int = 0
    # steps (and their row-steps) in buckets of more than `wide_rows` rows: an int4 rollout's
    # GEMMs there dequantize the weight and run bf16 (rollout.kernel_options.int4_kernel_max_rows)
    wide_steps: int = 0
    wide_row_steps: float = 0.0
    # partial rollouts: tokens re-prefilled for the carried rows (prompt + response so far)
    carried_prefill_tokens: float = 0.0
    # rollout.speculative: the tail's steps and row-steps (counted in `steps`, `row_steps` too)
    spec_steps: int = 0
    spec_row_steps: float = 0.0

    def __add__(self, o: "Decode") -> "Decode":
        return Decode(*(getattr(self, f.name) + getattr(o, f.name)
                        for f in fields(self)))


def _chunk(lengths: np.ndarray, *, prompt: int, cap: int | None, max_batch: int, compact: bool,
           window: int, exact_end: bool, wide_rows: int, own_prompt,
           spec: tuple | None = None) -> Decode:
    n = len(lengths)
    ladder = bucket_sizes(max_batch)
    b = next(x for x in ladder if x >= n)
    longest = int(lengths.max())
    steps = longest
    if not exact_end and cap is not None and longest < cap:   # ends at a poll, one poll late
        last = max(2 * CHECK_EVERY, math.ceil((longest + CHECK_EVERY - 1) / CHECK_EVERY) * CHECK_EVERY)
        steps = min(cap, last + 1)
    t = np.arange(steps, dtype=np.float64)
    if window:
        cache = math.ceil((prompt + (cap or longest)) / LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        cols = np.minimum(np.ceil((prompt + t + 1) / window) * window, cache)
    else:
        cols = prompt + t + 0.5      # the written columns, on average over the step's token
    rows = np.full(steps, float(b))
    moved, compactions = 0.0, 0
    srt = np.sort(lengths)
    # rollout.speculative: plain steps through token `start`, then the tail (the generator leaves
    # its decode loop at that poll: no compaction there or later)
    start = _spec_start(srt, steps, spec[0]) if spec else None
    tail_rows = min(spec[0], b) if spec else 0  # the tail's static rows (the cache holds b)
    if compact:
        targets = [x for x in ladder if x >= MIN_GRAPHED_BUCKET and x < b]
        for s in range(2 * CHECK_EVERY, steps if start is None else start, CHECK_EVERY):
            fit = next((x for x in targets if x >= max(_polled_live(srt, s), 1)), None)
            if fit is not None and fit < b and (fit <= b // 2 or fit == below_cap(b)):
                b = fit
                rows[s + 1:] = b
                moved += 2 * b * (prompt + s)
                compactions += 1
    if start is not None:
        t, rows, cols = t[:start + 1], rows[:start + 1], cols[:start + 1]
    wide = rows > wide_rows
    row_columns = float((rows * cols).sum())
    if own_prompt is not None:  # only live rows read, each its own prompt + tokens so far
        order = np.argsort(lengths, kind="stable")
        srt = lengths[order]
        own = np.broadcast_to(np.asarray(own_prompt, dtype=np.float64), lengths.shape)[order]
        done = np.searchsorted(srt, t, side="right")  # rows ended by token t
        live_prompts = own.sum() - np.concatenate([[0.0], np.cumsum(own)])[done]
        row_columns = float((live_prompts + (n - done) * (t + 0.5)).sum())
    out = Decode(steps=len(t), row_steps=float(rows.sum()), row_columns=row_columns,
                 moved_bytes=moved, compactions=compactions, chunks=1,
                 wide_steps=int(wide.sum()), wide_row_steps=float(rows[wide].sum()))
    if start is not None:
        own = prompt if own_prompt is None else own_prompt
        out = out + _spec_tail(lengths, start, np.broadcast_to(np.asarray(own, dtype=np.float64),
                                                               lengths.shape),
                               tail_rows=tail_rows, drafts=spec[1], per_step=spec[2])
    return out


def _polled_live(srt: np.ndarray, s: int) -> int:
    """The live count the stop poll after token s reads (sorted lengths `srt`): the snapshot
    taken one poll earlier, an upper bound (the first poll has none: polls start at
    2 x CHECK_EVERY)."""
    return len(srt) - int(np.searchsorted(srt, s - CHECK_EVERY + 1, side="right"))


def _spec_start(srt: np.ndarray, steps: int, max_rows: int) -> int | None:
    """The token after which rollout.speculative's tail takes over (sorted lengths `srt`): the
    first stop poll whose live count is at most max_rows, as the generator decides; None: never."""
    return next((s for s in range(2 * CHECK_EVERY, steps - 1, CHECK_EVERY)
                 if _polled_live(srt, s) <= max_rows), None)


def _spec_tail(lengths: np.ndarray, start: int, prompts: np.ndarray, *, tail_rows: int,
               drafts: int, per_step: float) -> Decode:
    """The speculative tail after token `start`: each running row gains `per_step` tokens a step
    until its length; every step computes tail_rows x (1 + drafts) tokens (the tail's static
    rows, finished ones as padding) and reads each running row's own columns once."""
    rest = lengths[lengths > start + 1] - (start + 1)
    if not len(rest):
        return Decode()
    steps_of = np.ceil(rest / per_step).astype(np.int64)  # each row's tail steps
    steps = int(steps_of.max())
    u = np.arange(steps, dtype=np.float64)
    live = (steps_of[None, :] > u[:, None])  # (steps, rows)
    own = prompts[lengths > start + 1]
    cols = own[None, :] + start + 1 + u[:, None] * per_step
    row_steps = float(steps * tail_rows * (1 + drafts))
    return Decode(steps=steps, row_steps=row_steps, row_columns=float((cols * live).sum()),
                  spec_steps=steps, spec_row_steps=row_steps)


@functools.lru_cache(maxsize=256)
def decode_schedule(w: Workload, rows: int, batch: int) -> Decode:
    """Decode work of one generation call of `rows` rows in chunks of `batch` rows."""
    lengths = row_lengths(w, rows)
    prompt = w.prompt_len_max or w.prompt_len
    # fixed lengths without a cap: every row runs to its length (the forced-length records)
    exact_end = w.response_lengths is None
    max_batch = w.gen_max_batch_size or batch
    cap, starts, carried = w.max_new_tokens, np.zeros(rows, dtype=np.int64), 0.0
    if w.partial_decode_steps:  # the steady state: every segment of the step's rows in one call
        lengths, starts = partial_segments(lengths, w.partial_decode_steps)
        cap = min(cap or w.partial_decode_steps, w.partial_decode_steps)
        batch = min(len(lengths), max_batch)
        carried = float((w.prompt_len + starts[starts > 0]).sum())
    total = Decode(carried_prefill_tokens=carried)
    for lo in range(0, len(lengths), batch):
        part = slice(lo, lo + batch)
        total = total + _chunk(lengths[part], prompt=prompt + int(starts[part].max()), cap=cap,
                               max_batch=max_batch, compact=w.compact_finished_rows,
                               window=w.decode_kv_window, exact_end=exact_end,
                               wide_rows=w.int4_kernel_max_rows,
                               own_prompt=w.prompt_len + starts[part] if w.own_columns_only
                               else None,
                               spec=(w.spec_rows, w.spec_draft_tokens, w.spec_tokens_per_step)
                               if w.spec_rows else None)
    return total


def partial_segments(lengths: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Partial rollouts: responses of `lengths` decoded at most `cap` tokens per call -> (each
    segment's length, the response tokens before it), the segments of a row side by side."""
    parts = [(min(cap, int(n) - s), s) for n in lengths for s in range(0, int(n), cap)]
    seg, start = zip(*parts)
    return np.asarray(seg, dtype=np.int64), np.asarray(start, dtype=np.int64)


# algo.packed_attention=varlen: a packed micro-batch's attention costs this share of what flex's
# document mask costs beyond maskless attention (`masked_attention`). Chosen on the GSM8K records
# that ran varlen (family grpo_today, benchmarks/varlen_records.py: the recipe's step of
# 2026-12-04 and the same with train graphs): over 0, 0.2, 0.25, 0.3 and 0.59, with the other
# coefficients refitted each time, 0.3 put the recipe's ref and update passes nearest (the scan's
# errors: docs/perf_log.md). The earlier 0.59 came from one A/B of the two kernels on passes of
# the older code (packed_varlen_h200.json).
VARLEN_MASKED_SHARE = 0.3
# algo.packed_attention=fa4 (FlashAttention-4's varlen kernels): chosen on the GSM8K records that
# ran fa4 (families grpo_fa4, the recipe on one H100 and one H200, and dapo_fa4, DAPO on one H100;
# benchmarks/varlen_records.py): over 0.16, 0.2, 0.24, 0.3 and 0.45, with the other coefficients
# refitted each time, 0.24 put their ref passes nearest held out (-0.4% / +2.5%; 0.16 -8.3% /
# -5.6%, 0.3 +5.6% / +8.7%); their updates stay 6-10% low at 0.24 and at 0.45 would be near, but
# that under-prediction is not attention's (the refs would be 21-24% high). bench_packed_pass.py's
# A/B of the two kernels alone (random weights) also gives 0.24. The earlier 0.16 came from one
# A/B of varlen against fa4 on the recipe's step, before any fa4 step was a record.
FA4_MASKED_SHARE = 0.24
# each packed kernel's share of flex's masked-attention extra cost
MASKED_SHARE = {"flex": 1.0, "varlen": VARLEN_MASKED_SHARE, "fa4": FA4_MASKED_SHARE}


@dataclass(frozen=True)
class PassWork:
    """One pass over a DP rank's rows: micro-batches and the tokens they compute."""
    micro: int
    tokens: float          # tokens computed (real tokens when packed, else padded rows)
    head_tokens: float     # positions whose LM head is computed
    attention: float       # sum over rows of (attended length)^2: causal attention ~ 2 L q_dim x it
    masked_attention: float  # `attention` of the micro-batches whose attention needs a mask
    eager_micro: int = 0   # padded_to_budget: the micro-batches too small to pad (eager layers)


@functools.lru_cache(maxsize=256)
def pass_work(w: Workload, rows: int, max_tokens: int, multiple: int = 1,
              padded_to_budget: bool = False) -> PassWork:
    """The micro-batches of `rows` rows under `max_tokens` tokens per micro-batch (token budget, or
    rows x the longest row for fixed micro-batches). `padded_to_budget`: each packed micro-batch
    computes the whole budget (the update's CUDA graphs replay one static shape: the rows' tokens,
    then padding; its attention is only the rows'), but those under `w.graph_min_fill` of it,
    which run the eager layers unpadded (`eager_micro`)."""
    r = row_lengths(w, rows)
    p = np.full(rows, w.prompt_len, dtype=np.int64)
    if not w.dynamic_bsz:   # the step's rows padded to its longest prompt and response
        width = (w.prompt_len_max or w.prompt_len) + int(r.max())
        width = math.ceil(width / multiple) * multiple
        per = max(1, max_tokens // width)
        micro = math.ceil(rows / per)
        head = rows * int(r.max()) if w.response_logits_only else rows * width
        masked = float(rows * width ** 2) if (r != r[0]).any() else 0.0   # rows padded: a mask
        return PassWork(micro, float(rows * width), float(head), float(rows * width ** 2), masked)
    import torch

    from hybridflow.data.microbatch import token_budget_groups

    groups = token_budget_groups(torch.from_numpy(p), torch.from_numpy(r), max_tokens=max_tokens,
                                 multiple=multiple, packed=w.pack_sequences,
                                 balanced=w.balanced_micro_batches and not padded_to_budget)
    tokens = head = attention = masked = 0.0
    eager = 0
    for g in groups:
        gp, gr = p[g], r[g]
        lengths = gp + gr
        if w.pack_sequences and not (lengths == lengths[0]).all():
            real = float(lengths.sum())
            pad = padded_to_budget and real >= w.graph_min_fill * max_tokens
            eager += padded_to_budget and not pad
            tokens += math.ceil(max(real, max_tokens if pad else 0) / multiple) * multiple
            # the update's graphs capture varlen whatever the eager passes run
            share = MASKED_SHARE["varlen" if pad else w.packed_attention]
            masked += share * float((lengths.astype(np.float64) ** 2).sum())
            head += float(gr.sum()) if w.response_logits_only else real
            attention += float((lengths.astype(np.float64) ** 2).sum())
        else:   # padded to the micro-batch's longest prompt + response
            width = math.ceil((int(gp.max()) + int(gr.max())) / multiple) * multiple
            tokens += len(g) * width
            if not (lengths == lengths[0]).all():    # padding: an explicit attention mask
                masked += len(g) * float(width) ** 2
            head += len(g) * (int(gr.max()) if w.response_logits_only else width)
            attention += len(g) * float(width) ** 2
    return PassWork(len(groups), tokens, head, attention, masked, int(eager))
