"""The long tail of a generate call by speculative sampling with n-gram drafts (rollout.speculative).

When few rows are left running, a decode step is bound by reading the weights and launching its
kernels, not by the rows: checking several tokens of each row in one step costs about what one token
costs. The drafts come from the row itself (prompt lookup): the tokens that followed the last
earlier occurrence of the row's last n tokens, n from `ngram_max` down to `ngram_min`, repeated
with that period where the occurrence is close (a loop drafts its own continuation). Math
reasoning copies numbers and phrases from the question, and a response that runs to
max_new_tokens is often a loop, which is what holds the tail.

One tail step, for the r rows still in the chunk's tail (`run_tail`):
1. the host drafts up to k tokens per running row (`NgramDrafter`), fewer near max_new_tokens;
2. one forward feeds each row its pending token and its drafts at the row's own cache columns and
   returns the logits at every fed position: `verify_fused` on the decode kernels (with
   kernels/spec_attention.py), else `multi_turn_step.extend` (PyTorch ops);
3. `accept` keeps draft j while a uniform draw falls below its probability under the target
   distribution p_j (log_softmax(logits / T), then top-k / top-p as the sampler filters), and
   draws one more token after the kept ones: from p without the rejected draft (renormalised), or
   from the distribution after the last draft when every draft was kept. This is speculative
   sampling (Leviathan et al., Chen et al.) with a draft distribution that puts all its mass on
   the drafted token: min(1, p / q) = p, and the residual (p - q)+ is p without the draft, so each
   emitted token has exactly the distribution plain decoding samples from. Greedy (T = 0) keeps
   the drafts equal to the argmax and emits the argmax after them: the plain greedy output;
4. the emitted tokens (cut after a stop token or at max_new_tokens) and their log-probs (the plain
   path's definition: log_softmax(logits / T) before filtering) go to the chunk's outputs; the
   columns of rejected drafts are marked invalid again, and the next step overwrites them.
The rows advance by different counts, so each keeps its own cache column, RoPE position and output
column. One host read per step (the emitted tokens, for the next drafts).
"""

from __future__ import annotations

from typing import Optional

import torch

from hybridflow.kernels.logprob_entropy import logprob_stats
from hybridflow.kernels.next_token import accept_advance_tail, advance_tail
from hybridflow.rollout import compaction
from hybridflow.rollout.cuda_graph import GraphedStep, WarmedStep
from hybridflow.rollout.multi_turn_step import extend
from hybridflow.rollout.sampling import draw, filter_logits


class NgramDrafter:
    """Per-row contexts (prompt + response so far) and, for each n in ngram_min..ngram_max, the
    position after the last occurrence of every n-gram that has a continuation."""

    def __init__(self, contexts: list, *, ngram_max: int, ngram_min: int):
        self.sizes = list(range(ngram_max, ngram_min - 1, -1))  # longest first
        self.ctx = [[int(t) for t in c] for c in contexts]
        # what `append` would have built token by token, in one pass per n-gram size: the n-gram
        # ctx[j:j + n] continues at e = j + n for e <= L - 1 (later occurrences overwrite)
        self.index = [{n: dict(zip(zip(*(c[m:len(c) - n + m] for m in range(n))),
                                   range(n, len(c)))) for n in self.sizes}
                      for c in self.ctx]

    def append(self, i: int, tokens) -> None:
        ctx, index = self.ctx[i], self.index[i]
        for t in tokens:
            e = len(ctx)  # the n-grams ending before position e now continue at e
            for n in self.sizes:
                if e >= n:
                    index[n][tuple(ctx[e - n:e])] = e
            ctx.append(int(t))

    def draft(self, i: int, k: int) -> list:
        """Up to k tokens that followed the last earlier occurrence of row i's longest matching
        suffix, continued periodically past the context's end; [] when none matches."""
        ctx, index = self.ctx[i], self.index[i]
        L = len(ctx)
        if k <= 0:
            return []
        for n in self.sizes:
            if L < n:
                continue
            c = index[n].get(tuple(ctx[L - n:]))
            if c is not None:
                period = L - c  # the suffix recurs this many tokens later
                return [ctx[c + j % period] for j in range(k)]
        return []


def accept(logits: torch.Tensor, drafts: torch.Tensor, n_draft: torch.Tensor, *,
           temperature: float, top_k: int, top_p: float,
           generator: Optional[torch.Generator] = None, need_logprobs: bool = True):
    """logits (r, S, V) at the fed positions (the pending token, then S - 1 drafts); drafts
    (r, S - 1) int64; n_draft (r,) the real drafts per row. Returns (emitted (r, S), kept (r,),
    logprobs (r, S) or None): row i emits emitted[i, :kept[i] + 1] (kept drafts, then one drawn
    token); entries past that are meaningless."""
    r, S, V = logits.shape
    dev = logits.device
    real = torch.arange(S - 1, device=dev) < n_draft[:, None]  # (r, S - 1)
    padded = torch.cat([drafts, drafts.new_zeros(r, 1)], 1)  # (r, S)
    if unfiltered(temperature, top_k, top_p, V):
        return _accept_unfiltered(logits, drafts, n_draft, real, padded,
                                  inv_temp=1.0 / temperature, generator=generator,
                                  need_logprobs=need_logprobs)
    if temperature == 0.0:  # the argmax in the logits' own dtype (exact), log-probs in one pass
        best = logits.argmax(-1)  # (r, S)
        ok = (best[:, :-1] == drafts) & real
        kept = ok.int().cumprod(1).sum(1)  # leading kept drafts
        emitted = _emitted(padded, kept, best.gather(1, kept[:, None]).squeeze(1))
        if not need_logprobs:
            return emitted, kept, None
        m, ssum, _, x = logprob_stats(logits, emitted, start=0, v_valid=V)
        return emitted, kept, x - (m + ssum.log())
    logits = logits.float()  # the fused step's are in the weights' dtype; the sampler reads fp32
    inv_temp = 1.0 / temperature
    values, ids = filter_logits(logits.reshape(r * S, V) * inv_temp, top_k=top_k, top_p=top_p)
    probs = torch.softmax(values, dim=-1)  # (r * S, K), 0 where filtered
    if ids is not None:  # back to vocabulary order
        probs = torch.zeros((r * S, V), dtype=probs.dtype, device=dev).scatter_(1, ids, probs)
    probs = probs.view(r, S, V)
    p_draft = probs[:, :-1].gather(2, drafts[..., None]).squeeze(-1)  # (r, S - 1)
    u = torch.rand((r, S - 1), generator=generator, device=dev)
    ok = (u < p_draft) & real
    kept = ok.int().cumprod(1).sum(1)
    p = probs.gather(1, kept[:, None, None].expand(r, 1, V)).squeeze(1)  # (r, V)
    emitted = _emitted(padded, kept, draw(p.masked_fill(_rejected(drafts, kept, n_draft, V), 0.0),
                                          generator))
    if not need_logprobs:
        return emitted, kept, None
    logp = torch.log_softmax(logits * inv_temp, dim=-1).gather(2, emitted[..., None]).squeeze(-1)
    return emitted, kept, logp


def _emitted(padded: torch.Tensor, kept: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Each row's kept drafts (padded (r, S)), then the token drawn after them (last (r,))."""
    S = padded.shape[1]
    return torch.where(torch.arange(S, device=padded.device) < kept[:, None], padded,
                       last[:, None])


def _rejected(drafts: torch.Tensor, kept: torch.Tensor, n_draft: torch.Tensor,
              V: int) -> torch.Tensor:
    """(r, V) bool: the draft a row rejected (the one after its kept ones), none where every
    real draft was kept: what the token drawn after the kept drafts must not be."""
    bad = drafts.gather(1, kept.clamp(max=drafts.shape[1] - 1)[:, None])
    return (kept < n_draft)[:, None] & (torch.arange(V, device=drafts.device) == bad)


def _accept_unfiltered(logits: torch.Tensor, drafts: torch.Tensor, n_draft: torch.Tensor,
                       real: torch.Tensor, padded: torch.Tensor, *, inv_temp: float,
                       generator: Optional[torch.Generator], need_logprobs: bool):
    """`accept` without top-k / top-p, reading the (r, S, V) logits once in their own dtype:
    one pass of kernels/logprob_entropy.logprob_stats gives each position's log-sum-exp and its
    draft's logit (p_draft = exp(x_draft - lse)), the drawn token is the exponential race
    argmax(x / T - log E) over the kept position's row with the rejected draft left out (draw's
    race on the same draws: p / E there), and the log-probs are x - lse at the emitted tokens.
    The same random draws as the filtered path, so the same tokens up to rounding near a tie."""
    r, S, V = logits.shape
    dev = logits.device
    m, ssum, x_draft, u, log_race = unfiltered_draws(logits, padded, inv_temp=inv_temp,
                                                     generator=generator)
    lse = m + ssum.log()  # (r, S)
    ok = (u < (x_draft[:, :-1] - lse[:, :-1]).exp()) & real
    kept = ok.int().cumprod(1).sum(1)
    row = logits.gather(1, kept[:, None, None].expand(r, 1, V)).squeeze(1)  # (r, V)
    score = row.float() * inv_temp - log_race
    last = score.masked_fill_(_rejected(drafts, kept, n_draft, V), float("-inf")).argmax(-1)
    emitted = _emitted(padded, kept, last)
    if not need_logprobs:
        return emitted, kept, None
    x_last = logits.gather(2, last[:, None, None].expand(r, S, 1)).squeeze(-1).float() * inv_temp
    at_draft = torch.arange(S, device=dev) < kept[:, None]
    return emitted, kept, torch.where(at_draft, x_draft, x_last) - lse


def unfiltered_draws(logits: torch.Tensor, padded: torch.Tensor, *, inv_temp: float,
                     generator: Optional[torch.Generator]) -> tuple:
    """What the unfiltered acceptance reads, in its order of random draws: (m, ssum, x_draft)
    of logprob_stats at the fed positions' drafts (padded (r, S)), the uniforms u (r, S - 1) of
    the drafts' tests and log E (r, V) of the exponential race for the token after them."""
    r, S, V = logits.shape
    m, ssum, _, x_draft = logprob_stats(logits, padded, start=0, v_valid=V, inv_temp=inv_temp)
    u = torch.rand((r, S - 1), generator=generator, device=logits.device)
    race = torch.empty((r, V), dtype=torch.float32, device=logits.device)
    race.exponential_(generator=generator)
    return m, ssum, x_draft, u, race.clamp_min_(torch.finfo(torch.float32).tiny).log_()


def unfiltered(temperature: float, top_k: int, top_p: float, vocab: int) -> bool:
    """Whether `accept` samples without top-k / top-p (`_accept_unfiltered`)."""
    return temperature > 0.0 and not 0 < top_k < vocab and top_p >= 1.0


class TailState:
    """Static tensors of the speculative tail for `rows` rows (a bucket: rows beyond the running
    ones are finished from the start), `S` fed tokens per row and step, `R` output columns, over
    a cache of T columns: what a captured tail step reads and writes."""

    def __init__(self, rows: int, S: int, R: int, T: int, device):
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
        self.pend, self.pos, self.col, self.out_step = z(rows), z(rows), z(rows), z(rows)
        self.finished = z(rows, dt=torch.bool)
        self.key_valid = z(rows, T, dt=torch.bool)
        self.drafts, self.n_draft = z(rows, S - 1), z(rows)  # written by the host every step
        # the rows' output columns; S more each as scratch for masked writes (one per position)
        self.out_tokens = z(rows, R + S)
        self.out_logprobs = z(rows, R + S, dt=torch.float32)
        # read by the host every step: the emitted tokens, their count, finished
        self.ret = z(rows, S + 2)

    def idle(self) -> None:
        """Every row finished: what warm-up runs and captures run on (they then write only the
        cache's scratch column and the outputs' scratch columns)."""
        self.finished.fill_(True)
        self.n_draft.zero_()
        self.col.zero_()
        self.out_step.zero_()


def tail_step(gen, st: TailState, cfg, opts, stop_ids: torch.Tensor):
    """The zero-argument tail step over `st` (graph-capturable: static shapes, no host sync)."""
    cache, (cos, sin) = gen._cache, gen._tables
    rows, S = st.drafts.shape[0], st.drafts.shape[1] + 1
    dev = st.pend.device
    ar = torch.arange(S, device=dev)
    t_ar = torch.arange(cache.length, device=dev)
    row_ix = torch.arange(rows, device=dev)[:, None]

    fused = fused_verify_applies(gen, opts)
    # rollout.speculative.fused_advance: the bookkeeping after the acceptance as one kernel,
    # with unfiltered sampling the acceptance before it as well (accept_advance_tail)
    advance_impl = "triton" if fused and opts.spec_fused_advance else "torch"
    fused_accept = advance_impl == "triton" and unfiltered(cfg.temperature, cfg.top_k, cfg.top_p,
                                                           gen.w.dims.true_vocab)
    if fused_accept:
        padded = torch.zeros((rows, S), dtype=torch.long, device=dev)  # the drafts, then a pad
        inv_temp = 1.0 / cfg.temperature

    def step():
        ids = torch.cat([st.pend[:, None], st.drafts], 1)  # (rows, S)
        if fused:
            logits = verify_fused(gen.w, ids, st.pos, st.col, 1 + st.n_draft, st.finished,
                                  st.key_valid, cache=cache, cos_tab=cos, sin_tab=sin, opts=opts)
        else:
            valid = (ar < (1 + st.n_draft)[:, None]) & ~st.finished[:, None]
            # padding tokens at the row's own position (past it the tables may end)
            positions = st.pos[:, None] + torch.where(valid, ar, 0)
            logits = extend(gen.w, ids, positions, valid, st.col, cache=cache,
                            key_valid=st.key_valid, cos_tab=cos, sin_tab=sin, every_position=True)
        if fused_accept:
            padded[:, :S - 1] = st.drafts
            draws = unfiltered_draws(logits, padded, inv_temp=inv_temp, generator=gen._rng)
            accept_advance_tail(st, logits, draws, stop_ids, inv_temp=inv_temp,
                                need_logprobs=cfg.return_logprobs, pdl=opts.pdl)
            return
        emitted, kept, lp = accept(logits, st.drafts, st.n_draft, temperature=cfg.temperature,
                                   top_k=cfg.top_k, top_p=cfg.top_p, generator=gen._rng,
                                   need_logprobs=cfg.return_logprobs)
        advance_tail(st, emitted, kept, lp, stop_ids, pdl=opts.pdl, impl=advance_impl,
                     aranges=(ar, t_ar, row_ix))

    return step


def run_tail(gen, tail: tuple, buf, row_map: torch.Tensor, out_tok: torch.Tensor,
             out_lp: torch.Tensor, *, prompts: list, P: int, s: int, opts, stats: dict) -> None:
    """Decode the running rows of bucket `buf` to their ends by speculative steps, writing their
    tokens and log-probs into the chunk's out_tok / out_lp (B + 1, R). Called after decode step s
    (output columns 0..s written, each row's pending token is column s, for cache column P + s);
    `prompts[c]` the prompt token ids of chunk row c (as given to generate). The bucket's outputs
    are flushed here; the caller does not flush them again. `tail`: `tail_step_for`'s (state, step)."""
    compaction.flush(buf, row_map, out_tok, out_lp)
    live = (~buf.finished).nonzero().squeeze(1)
    r = int(live.numel())
    if r == 0:
        return
    R = out_tok.shape[1]
    k = opts.spec_draft_tokens
    S = k + 1
    st, step = tail
    assert r <= st.drafts.shape[0], (r, st.drafts.shape)
    gen._cache.gather_rows(live, columns=P + s)  # the running rows' K/V into cache rows 0..r-1
    rows = row_map.index_select(0, live)  # (r,) chunk rows
    st.idle()
    st.finished[:r] = False
    st.key_valid.zero_()
    st.key_valid[:r] = buf.key_valid.index_select(0, live)
    st.pend[:r] = buf.tokens.index_select(0, live)
    st.pos[:r] = buf.positions.index_select(0, live)
    st.col[:r] = P + s
    st.out_step[:r] = s + 1
    st.out_tokens.zero_()
    st.out_logprobs.zero_()
    st.out_tokens[:r, :R] = out_tok.index_select(0, rows)
    st.out_logprobs[:r, :R] = out_lp.index_select(0, rows)
    so_far = st.out_tokens[:r, :s + 1].tolist()
    drafter = NgramDrafter([list(prompts[c]) + t for c, t in zip(rows.tolist(), so_far)],
                           ngram_max=opts.spec_ngram[0], ngram_min=opts.spec_ngram[1])
    rows_b = st.drafts.shape[0]
    # the host's work between two tail steps keeps the GPU idle: Python ints and lists, the
    # pinned buffers written once per step through numpy
    steps_h = [s + 1] * r  # output columns written per running row
    live = list(range(r))
    drafts_h = torch.zeros((rows_b, k), dtype=torch.long)
    n_h = torch.zeros(rows_b, dtype=torch.long)
    if gen.device.type == "cuda":
        drafts_h, n_h = drafts_h.pin_memory(), n_h.pin_memory()
    drafts_np, n_np = drafts_h.numpy(), n_h.numpy()
    no_drafts = [0] * k
    while live:
        drafts_l, n_l = [no_drafts] * rows_b, [0] * rows_b
        for i in live:
            d = drafter.draft(i, min(k, R - steps_h[i] - 1))
            drafts_l[i], n_l[i] = d + no_drafts[len(d):], len(d)
        drafts_np[:] = drafts_l
        n_np[:] = n_l
        st.drafts.copy_(drafts_h, non_blocking=True)
        st.n_draft.copy_(n_h, non_blocking=True)
        step()
        ret = st.ret[:r].tolist()  # the step's one host read
        emitted = rows_emitting = 0
        for i, row in enumerate(ret):
            n = row[S]
            if n:
                drafter.append(i, row[:n])
                steps_h[i] += n
                emitted += n
                rows_emitting += 1
        live = [i for i, row in enumerate(ret) if not row[S + 1]]
        stats["spec_steps"] += 1
        stats["spec_rows"] += rows_emitting
        stats["spec_drafted"] += sum(n_l)
        stats["spec_tokens"] += emitted
        stats["decode_row_steps"] += rows_b
    out_tok.index_copy_(0, rows, st.out_tokens[:r, :R])
    out_lp.index_copy_(0, rows, st.out_logprobs[:r, :R])


def fused_verify_applies(gen, opts) -> bool:
    """Whether the tail step runs the decode step's Triton layers (`verify_fused`): with
    rollout.decode_kernels resolved to triton, plain weights, a bf16 / fp16 / fp32 cache, dense
    layers (q/k norms included), TP_g = 1; else PyTorch ops (multi_turn_step.extend)."""
    w = gen.w
    return (opts.kernels == "triton" and gen.quantization == "none" and not gen._cache.fp8
            and w.dims.tp_size == 1 and all(layer.moe is None for layer in w.layers))


def verify_fused(w, ids: torch.Tensor, pos: torch.Tensor, col: torch.Tensor,
                 n_valid: torch.Tensor, finished: torch.Tensor, key_valid: torch.Tensor, *, cache,
                 cos_tab, sin_tab, opts) -> torch.Tensor:
    """ids (r, S) fed at RoPE positions pos + j and cache columns col + j (j < n_valid, unless the
    row is finished) -> logits (r, S, V) in the weights' dtype, on the single-turn decode step's
    layers (decoder._decode_step_fused: norm kernels, cuBLAS with the residual added in place, the
    SwiGLU kernel) over r x S rows, with kernels/spec_attention.py's attention (a q/k norm as
    layer_ops.qk_norm's PyTorch ops before it); key_valid marked at the written columns."""
    from hybridflow.kernels import layer_ops as kern
    from hybridflow.kernels.spec_attention import rope_attention_multi
    from hybridflow.rollout import decoder

    d = w.dims
    r, S = ids.shape
    hpg, hd, pdl = d.heads_per_group, d.head_dim, opts.pdl
    lin = decoder._linear_for(opts, True)
    x = None  # the first norm gathers the embedding
    for i, layer in enumerate(w.layers):
        x, h = (kern.add_rms_norm(w.embed, None, layer.ln1, d.eps, rows=ids.reshape(-1), pdl=pdl,
                                  impl="triton")
                if x is None else kern.add_rms_norm(x, None, layer.ln1, d.eps, pdl=pdl,
                                                    impl="triton"))
        qkv = lin(h, layer.qkv_w, layer.qkv_b).view(r, S, d.groups, hpg + 2, hd)
        if layer.q_norm is not None:  # Qwen3: q heads and k RMS-normed in place, before RoPE
            qk = qkv[:, :, :, :hpg + 1]
            qk.copy_(kern.qk_norm(qk, layer.q_norm, layer.k_norm, d.eps))
        kc, vc = cache.layer(i, r)
        a = rope_attention_multi(qkv, cos_tab, sin_tab, kc, vc, col, pos, n_valid, finished,
                                 key_valid, mark=i == 0, pdl=pdl, impl="triton")
        x = lin(a.view(r * S, d.heads * hd), layer.proj, residual=x)
        h = kern.add_rms_norm(x, None, layer.ln2, d.eps, pdl=pdl, impl="triton")[1]
        x = lin(kern.silu_mul(lin(h, layer.fc1), pdl=pdl, impl="triton"), layer.fc2, residual=x)
    h = kern.add_rms_norm(x, None, w.final_ln, d.eps, pdl=pdl, impl="triton")[1]
    return decoder.logits(w, h, fp32=False).view(r, S, -1)


def tail_step_for(gen, R: int, cfg, opts, key: tuple, stop_ids: list, graphed: bool):
    """(TailState, step) of a generate call's tail: opts.spec_rows rows, at most the cache's
    (fewer running ones ride as finished padding: at that size a step costs its weight reads and
    launches, not its rows), made once per output length, sampling `key` and options and kept
    with the generator's decode steps (released with them). Made before the call's seeding: a
    capture's warm-up runs draw random numbers."""
    rows, S = min(opts.spec_rows, gen._cache.rows), opts.spec_draft_tokens + 1
    k = ("speculative", rows, S, R, gen._cache.length, key, opts)
    if k in gen._steps:
        st, fns = gen._steps[k]
        return st, fns[None]
    st = TailState(rows, S, R, gen._cache.length, gen.device)
    st.idle()
    fn = tail_step(gen, st, cfg, opts,
                   torch.tensor(stop_ids, dtype=torch.long, device=gen.device))
    if graphed and gen.device.type == "cuda":
        if gen._pool is None:
            gen._pool, gen._side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        fn = GraphedStep(fn, pool=gen._pool, side=gen._side, generator=gen._rng)
    elif graphed:  # DecodeOptions.emulate_graphs: the warm-ups a capture makes
        fn = WarmedStep(fn)
    gen._steps[k] = (st, {None: fn})
    return st, fn


def speculative_metrics(stats: dict, *, into: dict) -> dict:
    """A generate call's tail counts (Generator.stats) added into a step's metrics `into` (a step
    may generate more than once: dynamic-sampling rounds): rollout/spec_steps (tail steps),
    spec_row_steps (running rows advanced, summed over steps), spec_drafted, spec_tokens (emitted)
    and the ratios spec_tokens_per_row_step and spec_draft_kept (kept drafts per drafted token;
    a stop or the length cap may cut a row's last step short)."""
    for key, name in (("spec_steps", "steps"), ("spec_rows", "row_steps"),
                      ("spec_drafted", "drafted"), ("spec_tokens", "tokens")):
        into[f"rollout/spec_{name}"] = into.get(f"rollout/spec_{name}", 0) + stats[key]
    rows, tokens = into["rollout/spec_row_steps"], into["rollout/spec_tokens"]
    into["rollout/spec_tokens_per_row_step"] = tokens / rows if rows else 0.0
    drafted = into["rollout/spec_drafted"]
    into["rollout/spec_draft_kept"] = (tokens - rows) / drafted if drafted else 0.0
    return into
