"""Greedy decoding's argmax over the vocabulary in two Triton passes, and a decode step's
bookkeeping after the draw in one launch.

`argmax_rows(logits)` = torch.argmax(logits, dim=-1) (the first maximal id on ties) for finite
logits (B, V): pass 1 runs a program per (row, chunk of `chunk` ids) that keeps a per-lane best and
writes the chunk's max and its first id; pass 2 reduces a row's chunks the same way. PyTorch's
reduction gives each row to one block, which at a decode batch of a few hundred rows and a
~150k-id vocabulary leaves most of the device idle; the split spreads a row over ~19 programs.
`advance_rows`: the step's bookkeeping after the draw (output column, stop check, token / position
/ column / step advance) as one kernel instead of ~10 small PyTorch kernels, greedy's pass 2
folded in when no log-probs are asked for. `advance_tail`: the same for a speculative tail step
(rollout/speculative.py) after its acceptance, one program per row; `accept_advance_tail` runs
the unfiltered sampled acceptance and that bookkeeping in two launches (the kept drafts and the
exponential race over vocabulary chunks, then the race's last pass folded into `advance_tail`'s
kernel). `pdl`: programmatic dependent launch where the device has it
(kernels/_dispatch.launch_opts).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._dispatch import HAVE_TRITON, launch_opts, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ._dispatch import pdl_enter

    @triton.jit
    def _lane_best(best_v, best_i, v, cols, ok, V):
        """Each lane's running best after a block of values v at ids cols (ok: real ids): strictly
        greater keeps a lane's first id; a lane's first id is taken even at -inf (best_i V: none)."""
        better = ok & ((v > best_v) | (best_i == V))
        return tl.where(better, v, best_v), tl.where(better, cols, best_i)

    @triton.jit
    def _first_max(v, i, V):
        """(the max of v, the smallest id of i holding it): ids V are none."""
        m = tl.max(v, 0)
        return m, tl.min(tl.where((v == m) & (i < V), i, V), 0)

    @triton.jit
    def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, V, s_x, NCHUNK, CHUNK: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        best_v = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], V, tl.int32)  # V: nothing seen yet in this lane
        for start in range(0, CHUNK, BLOCK):
            cols = c * CHUNK + start + tl.arange(0, BLOCK)
            ok = cols < V
            v = tl.load(x_ptr + row * s_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
            best_v, best_i = _lane_best(best_v, best_i, v, cols, ok, V)
        m, first = _first_max(best_v, best_i, V)
        tl.store(val_ptr + row * NCHUNK + c, m)
        tl.store(idx_ptr + row * NCHUNK + c, first)

    @triton.jit
    def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, V, NCHUNK, N_PAD: tl.constexpr,
                             PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, N_PAD)
        ok = c < NCHUNK
        v = tl.load(val_ptr + row * NCHUNK + c, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + row * NCHUNK + c, mask=ok, other=V)
        _, first = _first_max(v, i, V)
        tl.store(out_ptr + row, first.to(tl.int64))


def _check_logits(logits: torch.Tensor, chunk: int, block: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes (B, V) logits, got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("argmax_rows needs logits contiguous in the last dimension")
    if chunk % block:
        raise ValueError(f"argmax_rows: chunk {chunk} is not a multiple of block {block}")


def argmax_chunks(logits: torch.Tensor, *, chunk: int = 8192, block: int = 1024,
                  pdl: bool = False):
    """Pass 1 of argmax_rows: (max (B, nchunk) fp32, its first id (B, nchunk) int32) per chunk of
    `chunk` ids; `advance_rows(partials=...)` runs pass 2 in place of argmax_rows's."""
    _check_logits(logits, chunk, block)
    B, V = logits.shape
    nchunk = triton.cdiv(V, chunk)
    val = torch.empty((B, nchunk), dtype=torch.float32, device=logits.device)
    idx = torch.empty((B, nchunk), dtype=torch.int32, device=logits.device)
    if B:
        _argmax_chunk_kernel[(B, nchunk)](logits, val, idx, V, logits.stride(0), nchunk,
                                          CHUNK=chunk, BLOCK=block, num_warps=4,
                                          **launch_opts(logits, pdl))
    return val, idx


def argmax_rows(logits: torch.Tensor, *, chunk: int = 8192, block: int = 1024,
                pdl: bool = False, impl: str = "auto") -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for finite logits (B, V), last dimension contiguous -> (B,)
    int64; `chunk` ids per program of pass 1 (a multiple of `block`)."""
    if not use_triton(logits, impl):
        if logits.dim() != 2:
            raise ValueError(f"argmax_rows takes (B, V) logits, got shape {tuple(logits.shape)}")
        return torch.argmax(logits, dim=-1)
    val, idx = argmax_chunks(logits, chunk=chunk, block=block, pdl=pdl)
    B, nchunk = val.shape
    out = torch.empty((B,), dtype=torch.long, device=logits.device)
    if B:
        _argmax_final_kernel[(B,)](val, idx, out, logits.shape[1], nchunk,
                                   N_PAD=max(16, triton.next_power_of_2(nchunk)), num_warps=1,
                                   **launch_opts(val, pdl))
    return out


if HAVE_TRITON:

    @triton.jit
    def _advance_kernel(tok_ptr, val_ptr, idx_ptr, lp_ptr, fin_ptr, out_tok_ptr, out_lp_ptr,
                        stop_ptr, tokens_ptr, pos_ptr, cur_ptr, step_ptr, B, NSTOP, pad, V, NCHUNK,
                        s_ot, s_ol, FROM_CHUNKS: tl.constexpr, HAS_LP: tl.constexpr,
                        BLOCK: tl.constexpr, ROW_ITERS: tl.constexpr, N_PAD: tl.constexpr,
                        STOP_PAD: tl.constexpr, PDL: tl.constexpr = False):
        pdl_enter(PDL)
        # one program: it reads `step` first and advances it after every row is done
        step = tl.load(step_ptr)
        s = tl.arange(0, STOP_PAD)
        s_ok = s < NSTOP
        stops = tl.load(stop_ptr + s, mask=s_ok, other=0)
        for it in range(0, ROW_ITERS):
            r = it * BLOCK + tl.arange(0, BLOCK)
            ok = r < B
            if FROM_CHUNKS:  # argmax_rows's pass 2: the max of the chunks' maxima, its first id
                c = tl.arange(0, N_PAD)
                at = r[:, None] * NCHUNK + c[None, :]
                both = ok[:, None] & (c < NCHUNK)[None, :]
                v = tl.load(val_ptr + at, mask=both, other=float("-inf"))
                i = tl.load(idx_ptr + at, mask=both, other=V)
                m = tl.max(v, 1)
                tok = tl.min(tl.where((v == m[:, None]) & (i < V), i, V), 1).to(tl.int64)
            else:
                tok = tl.load(tok_ptr + r, mask=ok, other=0)
            fin = tl.load(fin_ptr + r, mask=ok, other=1) != 0
            tl.store(out_tok_ptr + r * s_ot + step, tl.where(fin, pad, tok), mask=ok)
            if HAS_LP:
                lp = tl.load(lp_ptr + r, mask=ok, other=0.0)
                tl.store(out_lp_ptr + r * s_ol + step, tl.where(fin, 0.0, lp), mask=ok)
            hit = tl.sum(((tok[:, None] == stops[None, :]) & s_ok[None, :]).to(tl.int32), 1) > 0
            tl.store(fin_ptr + r, (fin | hit).to(tl.uint8), mask=ok)
            tl.store(tokens_ptr + r, tok, mask=ok)
            tl.store(pos_ptr + r, tl.load(pos_ptr + r, mask=ok, other=0) + 1, mask=ok)
        tl.debug_barrier()  # every warp has read `step` before it moves
        tl.store(step_ptr, step + 1)
        tl.store(cur_ptr, tl.load(cur_ptr) + 1)


def advance_rows(*, finished: torch.Tensor, out_tokens: torch.Tensor, stop_ids: torch.Tensor,
                 tokens: torch.Tensor, positions: torch.Tensor, cur: torch.Tensor,
                 step: torch.Tensor, pad: int, tok: Optional[torch.Tensor] = None,
                 partials=None, vocab: int = 0, lp: Optional[torch.Tensor] = None,
                 out_logprobs: Optional[torch.Tensor] = None, pdl: bool = False) -> None:
    """A decode step's bookkeeping after its draw as one kernel launch (~10 small PyTorch kernels
    before): with the drawn tokens `tok` (B,) int64, or greedy's `partials` (argmax_chunks of
    logits with `vocab` ids: their pass 2 runs here),
        out_tokens[:, step] = pad where finished else tok   (out_logprobs[:, step]: 0 / lp)
        finished |= tok in stop_ids;  tokens = tok;  positions += 1;  cur += 1;  step += 1
    All on one device (a CUDA one, or CPU under TRITON_INTERPRET=1); finished (B,) bool,
    out_tokens (B, R) int64, out_logprobs (B, R) fp32, cur and step (1,) int64."""
    if (tok is None) == (partials is None):
        raise ValueError("advance_rows takes the drawn tokens or argmax partials, one of them")
    if (lp is None) != (out_logprobs is None):
        raise ValueError("advance_rows: lp and out_logprobs come together")
    B = finished.shape[0]
    val, idx = partials if partials is not None else (finished, finished)  # unread without them
    if partials is not None and (val.shape[0] != B or vocab <= 0):
        raise ValueError(f"advance_rows: partials for {val.shape[0]} rows and vocab {vocab}, "
                         f"expected {B} rows and a positive vocab")
    nchunk = val.shape[1] if partials is not None else 1
    block = min(256, max(16, triton.next_power_of_2(B)))
    no_lp = out_logprobs is None
    _advance_kernel[(1,)](
        tokens if tok is None else tok, val, idx, out_tokens if no_lp else lp,
        finished.view(torch.uint8), out_tokens, out_tokens if no_lp else out_logprobs, stop_ids,
        tokens, positions, cur, step, B, stop_ids.numel(), pad, vocab, nchunk,
        out_tokens.stride(0), 0 if no_lp else out_logprobs.stride(0),
        FROM_CHUNKS=partials is not None, HAS_LP=not no_lp, BLOCK=block,
        ROW_ITERS=triton.cdiv(B, block), N_PAD=max(16, triton.next_power_of_2(nchunk)),
        STOP_PAD=max(2, triton.next_power_of_2(stop_ids.numel())), num_warps=4,
        **launch_opts(tokens, pdl))


if HAVE_TRITON:

    @triton.jit
    def _advance_tail_kernel(em_ptr, kept_ptr, lp_ptr, nd_ptr, stop_ptr, pend_ptr, pos_ptr,
                             col_ptr, ostep_ptr, fin_ptr, kv_ptr, out_tok_ptr, out_lp_ptr, ret_ptr,
                             S, R, T, NSTOP, s_em, s_lp, s_kv, s_ot, s_ol, s_ret,
                             val_ptr, idx_ptr, dr_ptr, m_ptr, ss_ptr, xd_ptr, lg_ptr, V, NCHUNK,
                             s_dr, s_lg0, s_lg1, inv_temp,
                             HAS_LP: tl.constexpr, S_PAD: tl.constexpr, STOP_PAD: tl.constexpr,
                             RACE: tl.constexpr = False, N_PAD: tl.constexpr = 16,
                             PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, S_PAD)
        jm = j < S
        kept = tl.load(kept_ptr + row)
        if RACE:  # accept_advance_tail: the race's last pass, the emitted tokens, their log-probs
            c = tl.arange(0, N_PAD)
            v = tl.load(val_ptr + row * NCHUNK + c, mask=c < NCHUNK, other=float("-inf"))
            i = tl.load(idx_ptr + row * NCHUNK + c, mask=c < NCHUNK, other=V)
            _, last = _first_max(v, i, V)
            last = last.to(tl.int64)
            d = tl.load(dr_ptr + row * s_dr + j, mask=j < S - 1, other=0)
            em = tl.where(j < kept, d, last)
            if HAS_LP:
                lse = (tl.load(m_ptr + row * S + j, mask=jm, other=0.0)
                       + tl.log(tl.load(ss_ptr + row * S + j, mask=jm, other=1.0)))
                xd = tl.load(xd_ptr + row * S + j, mask=jm, other=0.0)
                x_last = tl.load(lg_ptr + row * s_lg0 + j * s_lg1 + last, mask=jm,
                                 other=0.0).to(tl.float32) * inv_temp
                lp = tl.where(j < kept, xd, x_last) - lse
        else:
            em = tl.load(em_ptr + row * s_em + j, mask=jm, other=0)
            if HAS_LP:
                lp = tl.load(lp_ptr + row * s_lp + j, mask=jm, other=0.0)
        nd = tl.load(nd_ptr + row)
        col = tl.load(col_ptr + row)
        ostep = tl.load(ostep_ptr + row)
        fin = tl.load(fin_ptr + row) != 0
        k = tl.arange(0, STOP_PAD)
        stops = tl.load(stop_ptr + k, mask=k < NSTOP, other=0)
        hit = tl.sum(((em[:, None] == stops[None, :]) & (k < NSTOP)[None, :]).to(tl.int32), 1) > 0
        stop = hit & jm & (j < kept + 1)
        any_stop = tl.sum(stop.to(tl.int32), 0) > 0
        first = tl.min(tl.where(stop, j, S_PAD), 0)
        n_emit = tl.where(any_stop, first + 1, kept + 1)
        n_emit = tl.minimum(n_emit, R - ostep)
        n_emit = tl.where(fin, 0, n_emit)
        # the rejected drafts' columns col + kept + 1 .. col + n_draft are free again
        c = col + kept + 1 + j
        tl.store(kv_ptr + row * s_kv + c, tl.zeros([S_PAD], tl.uint8),
                 mask=(j < S - 1) & (c <= col + nd) & (c < T))
        at = tl.where(j < n_emit, ostep + j, R + j)  # past the emitted ones: the scratch columns
        tl.store(out_tok_ptr + row * s_ot + at, em, mask=jm)
        if HAS_LP:
            tl.store(out_lp_ptr + row * s_ol + at, lp, mask=jm)
        last = tl.sum(tl.where(j == tl.maximum(n_emit - 1, 0), em, 0), 0)
        live = fin == 0
        tl.store(pend_ptr + row, tl.where(live, last, tl.load(pend_ptr + row)))
        adv = tl.where(live, kept + 1, 0)
        tl.store(pos_ptr + row, tl.load(pos_ptr + row) + adv)
        tl.store(col_ptr + row, col + adv)
        ostep = ostep + n_emit
        tl.store(ostep_ptr + row, ostep)
        fin = fin | any_stop | (ostep >= R)
        tl.store(fin_ptr + row, fin.to(tl.uint8))
        tl.store(ret_ptr + row * s_ret + j, em, mask=jm)
        tl.store(ret_ptr + row * s_ret + S, n_emit.to(tl.int64))
        tl.store(ret_ptr + row * s_ret + S + 1, fin.to(tl.int64))


def _no_race(t: torch.Tensor) -> tuple:
    """advance_tail's kernel arguments of the race (accept_advance_tail's), unread without it."""
    return (t,) * 7 + (0,) * 5 + (1.0,)


def advance_tail(st, emitted: torch.Tensor, kept: torch.Tensor, lp: Optional[torch.Tensor],
                 stop_ids: torch.Tensor, *, pdl: bool = False, impl: str = "auto",
                 aranges: Optional[tuple] = None) -> None:
    """A speculative tail step's bookkeeping after its acceptance (rollout/speculative.py), on
    the step's TailState `st` in place: the emitted tokens (rows, S) cut at the first stop among
    the kept + 1 and at the output length R, written (with their log-probs `lp`) at each row's
    output step; the rejected drafts' cache columns unmarked; pending token, position, cache
    column, output step and finished advanced; the host's `ret` row (tokens, count, finished).
    One program per row (the PyTorch twin: ~50 small kernels, `aranges` its (S,), (T,) and
    (rows, 1) index tensors when made once outside a captured step); impl as
    _dispatch.use_triton."""
    rows, S = emitted.shape
    R = st.out_tokens.shape[1] - S
    if not use_triton(emitted, impl):
        return _advance_tail_torch(st, emitted, kept, lp, stop_ids, aranges)
    no_lp = lp is None
    emitted = emitted.contiguous()  # the kernel walks a row's S values with unit stride
    lp = None if no_lp else lp.contiguous()
    _advance_tail_kernel[(rows,)](
        emitted, kept, emitted if no_lp else lp, st.n_draft, stop_ids, st.pend, st.pos, st.col,
        st.out_step, st.finished.view(torch.uint8), st.key_valid.view(torch.uint8),
        st.out_tokens, st.out_tokens if no_lp else st.out_logprobs, st.ret, S, R,
        st.key_valid.shape[1], stop_ids.numel(), emitted.stride(0), 0 if no_lp else lp.stride(0),
        st.key_valid.stride(0), st.out_tokens.stride(0), st.out_logprobs.stride(0),
        st.ret.stride(0), *_no_race(emitted), HAS_LP=not no_lp,
        S_PAD=max(16, triton.next_power_of_2(S)),
        STOP_PAD=max(2, triton.next_power_of_2(stop_ids.numel())), num_warps=1,
        **launch_opts(emitted, pdl))


if HAVE_TRITON:

    @triton.jit
    def _race_chunk_kernel(lg_ptr, g_ptr, m_ptr, ss_ptr, xd_ptr, u_ptr, dr_ptr, nd_ptr, kept_ptr,
                           val_ptr, idx_ptr, S, V, NCHUNK, s_lg0, s_lg1, s_g, s_u, s_dr, inv_temp,
                           CHUNK: tl.constexpr, BLOCK: tl.constexpr, S_PAD: tl.constexpr,
                           PDL: tl.constexpr = False):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        j = tl.arange(0, S_PAD)
        jd = j < S - 1
        # the kept drafts: draft j while u_j < p_j = exp(x_j - lse_j), the leading run of them
        lse = (tl.load(m_ptr + row * S + j, mask=jd, other=0.0)
               + tl.log(tl.load(ss_ptr + row * S + j, mask=jd, other=1.0)))
        xd = tl.load(xd_ptr + row * S + j, mask=jd, other=0.0)
        u = tl.load(u_ptr + row * s_u + j, mask=jd, other=2.0)
        nd = tl.load(nd_ptr + row)
        ok = (u < tl.exp(xd - lse)) & jd & (j < nd)
        kept = tl.min(tl.where(ok, S_PAD, j), 0)
        # the draft rejected after them (none when every real draft was kept) is left out
        d = tl.load(dr_ptr + row * s_dr + j, mask=jd, other=0)
        bad = tl.sum(tl.where(j == tl.minimum(kept, S - 2), d, 0), 0)
        has_bad = kept < nd
        base = lg_ptr + row * s_lg0 + kept.to(tl.int64) * s_lg1
        best_v = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], V, tl.int32)
        for start in range(0, CHUNK, BLOCK):
            cols = c * CHUNK + start + tl.arange(0, BLOCK)
            in_v = cols < V
            x = tl.load(base + cols, mask=in_v, other=0.0).to(tl.float32)
            score = x * inv_temp - tl.load(g_ptr + row * s_g + cols, mask=in_v, other=0.0)
            score = tl.where(has_bad & (cols == bad), float("-inf"), score)
            best_v, best_i = _lane_best(best_v, best_i, score, cols, in_v, V)
        m, first = _first_max(best_v, best_i, V)
        tl.store(val_ptr + row * NCHUNK + c, m)
        tl.store(idx_ptr + row * NCHUNK + c, first)
        if c == 0:
            tl.store(kept_ptr + row, kept.to(tl.int64))


def accept_advance_tail(st, logits: torch.Tensor, draws: tuple, stop_ids: torch.Tensor, *,
                        inv_temp: float, need_logprobs: bool, chunk: int = 8192,
                        block: int = 1024, pdl: bool = False) -> None:
    """A speculative tail step's unfiltered sampled acceptance and bookkeeping in two launches:
    rollout/speculative.py's `_accept_unfiltered` (its twin, with `advance_tail`) on the same
    random draws `draws` = (m, ssum, x_draft, u, log_race) from `unfiltered_draws`: the kept
    drafts (u_j < exp(x_j - lse_j), leading run), the token after them as
    argmax(x / T - log E) over the kept position's logits without the rejected draft (one
    program per row and chunk of `chunk` ids), then advance_tail's kernel reducing the chunks and
    writing the emitted tokens and their log-probs (x - lse) with the rest of its bookkeeping.
    logits (rows, S, V) in any float dtype, last dimension contiguous."""
    rows, S, V = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("accept_advance_tail needs logits contiguous in the last dimension")
    if chunk % block:
        raise ValueError(f"accept_advance_tail: chunk {chunk} is not a multiple of block {block}")
    m, ssum, x_draft, u, log_race = draws
    m, ssum, x_draft = m.contiguous(), ssum.contiguous(), x_draft.contiguous()
    R = st.out_tokens.shape[1] - S
    nchunk = triton.cdiv(V, chunk)
    dev = logits.device
    val = torch.empty((rows, nchunk), dtype=torch.float32, device=dev)
    idx = torch.empty((rows, nchunk), dtype=torch.int32, device=dev)
    kept = torch.empty((rows,), dtype=torch.long, device=dev)
    s_pad = max(16, triton.next_power_of_2(S))
    _race_chunk_kernel[(rows, nchunk)](
        logits, log_race, m, ssum, x_draft, u, st.drafts, st.n_draft, kept, val, idx, S, V,
        nchunk, logits.stride(0), logits.stride(1), log_race.stride(0), u.stride(0),
        st.drafts.stride(0), inv_temp, CHUNK=chunk, BLOCK=block, S_PAD=s_pad, num_warps=4,
        **launch_opts(logits, pdl))
    out_lp = st.out_logprobs if need_logprobs else st.out_tokens
    _advance_tail_kernel[(rows,)](
        st.drafts, kept, x_draft, st.n_draft, stop_ids, st.pend, st.pos, st.col, st.out_step,
        st.finished.view(torch.uint8), st.key_valid.view(torch.uint8), st.out_tokens, out_lp,
        st.ret, S, R, st.key_valid.shape[1], stop_ids.numel(), 0, 0, st.key_valid.stride(0),
        st.out_tokens.stride(0), out_lp.stride(0), st.ret.stride(0),
        val, idx, st.drafts, m, ssum, x_draft, logits, V, nchunk, st.drafts.stride(0),
        logits.stride(0), logits.stride(1), inv_temp, HAS_LP=need_logprobs, S_PAD=s_pad,
        STOP_PAD=max(2, triton.next_power_of_2(stop_ids.numel())), RACE=True,
        N_PAD=max(16, triton.next_power_of_2(nchunk)), num_warps=1, **launch_opts(logits, pdl))


def _advance_tail_torch(st, emitted, kept, lp, stop_ids, aranges=None) -> None:
    rows, S = emitted.shape
    R = st.out_tokens.shape[1] - S
    dev = emitted.device
    ar, t_ar, row_ix = aranges or (torch.arange(S, device=dev),
                                   torch.arange(st.key_valid.shape[1], device=dev),
                                   torch.arange(rows, device=dev)[:, None])
    n_emit = kept + 1
    stop = (emitted[..., None] == stop_ids).any(-1) & (ar < n_emit[:, None])
    n_emit = torch.where(stop.any(1), stop.int().argmax(1) + 1, n_emit)
    n_emit = torch.minimum(n_emit, R - st.out_step).masked_fill(st.finished, 0)
    # extend marked the drafts' columns valid: a rejected draft's column is free again
    st.key_valid &= ~((t_ar > (st.col + kept)[:, None]) & (t_ar <= (st.col + st.n_draft)[:, None]))
    m = ar < n_emit[:, None]
    at = (row_ix.expand(rows, S), torch.where(m, st.out_step[:, None] + ar, R + ar))
    st.out_tokens.index_put_(at, emitted)
    if lp is not None:
        st.out_logprobs.index_put_(at, lp)
    live = ~st.finished
    last = emitted.gather(1, (n_emit - 1).clamp(min=0)[:, None]).squeeze(1)
    st.pend.copy_(torch.where(live, last, st.pend))
    st.pos.add_(torch.where(live, kept + 1, 0))
    st.col.add_(torch.where(live, kept + 1, 0))
    st.out_step.add_(n_emit)
    st.finished |= stop.any(1) | (st.out_step >= R)
    st.ret[:, :S].copy_(emitted)
    st.ret[:, S] = n_emit
    st.ret[:, S + 1] = st.finished.long()
