"""In-place generation on the training ranks: `Generator` (KV cache, prefill + decode, sampling).

    gen = Generator(model_cfg=..., params=gen_layout_params, tp_group=tp_g_group, device=...,
                    dtype=torch.bfloat16, true_vocab_size=V)
    batch = gen.generate(prompts, cfg=rollout_cfg, eos_id=eos, pad_id=pad, seed=step_seed,
                         options=DecodeOptions.from_config(rollout_cfg))  # a RolloutBatch
    gen.release()   # KV cache, graphs, static buffers gone; the training phases get the memory back

Every rank of a TP_g group must call `generate` with the same prompts and seed: the ranks hold
identical gathered logits and identically seeded generators, so they draw the same tokens and issue
the same collectives. The Generator keeps references to `params` (owned by the caller / reshard).

Layout of a call:
- Rows: each prompt repeated `cfg.n` times consecutively [p0s0, p0s1, ..., p1s0, ...]. Rows are
  LEFT-padded to the longest prompt P (all prompts end at column P-1, so the prefill's last column
  predicts every row's first token); position ids count real tokens only (0 at a row's first real
  token), so a padded row computes exactly what it would alone.
- Rows are processed in chunks of at most `cfg.max_batch_size`. Per chunk: eager prefill (SDPA over
  the prompt, K/V into the static cache, first token sampled from the last column), then one decode
  step per new token: a CUDA-graph replay on GPU (bucketed batch sizes, see cuda_graph.py), the same
  function eagerly on CPU or with `options.cuda_graphs` off.
- How it decodes (kernels, graphs, compile, windows, compaction, launch options) is one
  `DecodeOptions` (options.py) per call; it is part of the key of the captured steps, so a call
  with other options captures (and keeps) its own.
- Attention windows (`options.kv_window` W > 0): a decode step attends over the first multiple of
  W cache columns that holds every written slot, not the whole P + R cache (`kv_windows`): a graph
  per window and bucket, all on the bucket's buffers; the host picks one per step from the step
  index (no sync). Early steps of a long budget, when the batch is fullest, read a fraction of the
  cache. The output is the whole-cache output (the columns left out are masked there).
- The prefill runs once per run of equal prompts of a chunk (a prompt's n copies, and equal
  prompts side by side; a chunk may cut a run: that prompt is prefilled in both chunks), in
  sub-batches of at most `options.prefill_tokens` tokens, each over the columns of its own widest
  prompt rounded up to `options.prefill_width_multiple` (`prefill_batches`; the prompts are
  left-padded to room for that), into the cache's first rows; its K/V columns 0..P-1 are
  then copied to the rows of its copies and its last-column logits expanded to them, so each of the
  n rows draws its own first token from the same distribution. The first draw has the (B, V) shape
  of a per-row prefill, so the random stream, hence the output, is that of prefilling every row (up
  to a matmul's batch-size-dependent rounding, see compaction.py).
- Quantized rollouts (`quantization` "fp8" / "int4", rollout/quantize.py): the layers' matrices are
  quantized once at construction (the generator holds the codes, not a bf16 copy; they go with it);
  `requantize(params)` rewrites them in place from updated weights, so a generator kept across
  steps keeps its captured graphs. Log-probs are the quantized model's.
- fp8 KV cache (`cfg.kv_cache_dtype` "fp8", kernels/kv_fp8.py): the cache holds E4M3 codes and a
  scale per (row, KV head, column), allocated per call's kind (a call of the other kind replaces
  the cache and its graphs). Log-probs are the fp8-cache model's.
- Stopping: a row finishes at EOS, any `cfg.stop_token_ids`, or `max_new_tokens`; finished rows
  emit pad. Every `options.check_every` steps the live-row count is polled asynchronously (no host
  sync per step): the loop ends once every row finished, and with `options.compact_finished_rows`
  the live rows
  move to a smaller bucket once they fit in half the current one (compaction.py), so a long tail
  of response lengths does not hold the whole batch.
"""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import torch
from torch.profiler import record_function

from hybridflow.config import ModelConfig, RolloutConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.rollout import compaction, decoder, speculative
from hybridflow.rollout.cuda_graph import (GraphedStep, StopPoller, WarmedStep, bucket_for,
                                           bucket_sizes, free_workspaces)
from hybridflow.rollout.kv_cache import KVCache, kv_cache_nbytes
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.quantize import quantize_weights, quantized_bytes, requantize_weights_
from hybridflow.rollout.sampling import sample

# cache length rounding: fewer re-captures, aligned attention masks; rollout.decode_kv_window is a
# multiple of it, so windows end on its multiples
LENGTH_MULTIPLE = 64


class _Buffers:
    """Static state of one batch bucket: what a captured decode step reads and writes."""

    def __init__(self, rows: int, length: int, max_new: int, stop_ids: list, device,
                 experts: Optional[tuple] = None):
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
        self.tokens, self.positions = z(rows), z(rows)  # (b,) last sampled token, its position
        self.cur, self.step = z(1), z(1)  # cache column / output column of the next token
        self.key_valid = z(rows, length, dt=torch.bool)  # (b, T) cache slots a query may see
        self.finished = z(rows, dt=torch.bool)
        self.out_tokens = z(rows, max_new)  # (b, R)
        self.out_logprobs = z(rows, max_new, dt=torch.float32)
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
        # `experts` (L, k): the routing a step's MoE layers chose (b, L, k) and, per response
        # column, each fed token's (b, R, L, k) int16 (recording; -1: none)
        self.experts = self.out_experts = None
        if experts is not None:
            self.experts = torch.full((rows, *experts), -1, dtype=torch.int16, device=device)
            self.out_experts = torch.full((rows, max_new, *experts), -1, dtype=torch.int16,
                                          device=device)

    def is_stop(self, tok):
        return (tok[:, None] == self.stop_ids).any(1)

    def reset(self, *, tok, lp, lengths, mask, pad_id: int):
        """Start a chunk: first tokens `tok` (B,) from the prefill, prompt `mask` (B, P)."""
        B, P = mask.shape
        self.out_tokens.fill_(pad_id)
        self.out_logprobs.zero_()
        if self.out_experts is not None:
            self.out_experts.fill_(-1)
        self.out_tokens[:B, 0] = tok
        if lp is not None:
            self.out_logprobs[:B, 0] = lp
        self.finished.fill_(True)  # bucket rows beyond B are finished from the start
        self.finished[:B] = self.is_stop(tok)
        self.tokens.zero_()
        self.tokens[:B] = tok
        self.positions.zero_()
        self.positions[:B] = lengths
        self.cur.fill_(P)
        self.step.fill_(1)
        self.key_valid.zero_()
        self.key_valid[:B, :P] = mask.bool()


class Generator:
    def __init__(self, *, model_cfg: ModelConfig, params: dict, tp_group, device: torch.device,
                 dtype: torch.dtype, true_vocab_size: int, quantization: str = "none",
                 fetch=None):
        """`fetch` (with a quantization): the layers' matrices in `params` are taken as they are
        (e.g. host tensors) and each is quantized from `fetch(layer, field, tensor)`, a device
        tensor dropped after (rollout/quantize.py quantize_weights)."""
        self.cfg = model_cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantization = quantization
        self._load = dict(group=tp_group, true_vocab_size=true_vocab_size, device=self.device,
                          dtype=dtype)
        if fetch is not None and quantization == "none":
            raise ValueError("Generator(fetch=...) quantizes matrices as they come: it needs a "
                             "quantization")
        w = decoder.load_weights(model_cfg, params, **self._load,
                                 matrices_as_given=fetch is not None)
        # the storage of every given tensor, when the weights alias it (no dtype/device copy):
        # then in-place updates of `params` are what the next call generates with (`reusable`;
        # quantized weights: after `requantize`)
        self._param_ptrs = {n: t.data_ptr() for n, t in params.items()}
        ptrs = set(self._param_ptrs.values())
        self._aliased = all(t.data_ptr() in ptrs for t in decoder.weight_tensors(w))
        if quantization == "fp8" and self.device.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError(f"rollout.quantization=fp8 on a GPU needs bf16 weights "
                             f"(torch._scaled_mm's row-wise scales give bf16); the model runs "
                             f"in {dtype}: set trainer.precision=bf16")
        self.w = quantize_weights(w, quantization, fetch)
        del w
        self.quantized_bytes = quantized_bytes(self.w)  # the codes + scales this generator holds
        self._rng = torch.Generator(device=self.device)
        # the fused sampler's stream (rollout.kernel_options.fused_sampler): [key, counter] on the
        # device, re-keyed by every call's seed; captured steps read and advance it in place
        from hybridflow.kernels.sample import new_rng_state  # kernels: imported when used

        self._rng_state = new_rng_state(0, self.device)
        self._cache: Optional[KVCache] = None
        self._tables = None  # rope (cos, sin) for the cache length
        # (rows, max_new, sampling key, windows, DecodeOptions) -> (buffers, {kv_len: step fn})
        self._steps: dict = {}
        self._pool = self._side = None  # graph memory pool, warm-up stream
        self._poller: Optional[StopPoller] = None
        # host-side counts of the last generate call (no sync): decode row-steps run, what the
        # same steps would have cost without compaction, compactions, prefill sub-batches and
        # their rows, decode steps per attention window (kv_len -> steps; None: the whole cache)
        self.stats = _new_stats()

    # ---- public -------------------------------------------------------------------------------
    def generate(self, prompts: list, *, cfg: RolloutConfig, eos_id: int, pad_id: int,
                 seed: int, options: Optional[DecodeOptions] = None,
                 record_experts: bool = False) -> RolloutBatch:
        """Sample `cfg.n` responses per prompt. Returns the rows as the trainer consumes them, on
        the device: B = len(prompts) * n rows [p0s0, p0s1, ..., p1s0, ...], prompts LEFT-padded to
        the longest (pad_id), responses right-padded to the longest produced, masks 1 up to and
        including the stop token, `group_ids` = `indices` = the prompt's position in `prompts`
        (callers map them to global ids), `rollout_logprobs` (B, R) when cfg.return_logprobs: each
        sampled token's log-prob under log_softmax(logits / T) (T = 1 when greedy), before
        top-k/top-p filtering (as verl's), 0 on padding.

        `cfg` says what to sample (n, max_new_tokens, temperature, top_k, top_p, stop ids,
        max_batch_size, return_logprobs); `options` how to decode (None:
        DecodeOptions.from_config(cfg); given, cfg's decode keys are not read).
        `record_experts` (MoE models; actor.router_replay=R3): the batch also carries the experts
        every MoE layer routed each prompt and response token to (`prompt_experts`,
        `response_experts`, int16, -1 where nothing was routed: prompt padding, a response's
        last token and what follows it)."""
        opts = options or DecodeOptions.from_config(cfg)
        if self.cfg.moe.enabled and opts.kernels == "auto":  # the Triton layers are dense-only
            opts = opts.replace(kernels="torch")
        opts = opts.resolved(self.device, self.w.dims.head_dim)
        # the phases carry profiler labels (generate.setup / .prefill / .decode / .finish): a trace
        # (benchmarks/profile_decode.py --timeline) attributes the GPU's idle time to them
        with torch.no_grad(), record_function("generate.setup"):
            self._check_options(opts)
            if record_experts and not self.cfg.moe.enabled:
                raise ValueError("recording the routed experts needs a mixture-of-experts model "
                                 "(model.moe.num_experts > 0)")
            record = (self.cfg.num_layers, self.cfg.moe.top_k) if record_experts else None
            ids, mask = self._padded_prompts(prompts, cfg, pad_id)
            N, (_, P), R = len(prompts) * cfg.n, ids.shape, cfg.max_new_tokens
            if P + R > self.cfg.max_position_embeddings:
                raise ValueError(f"longest prompt {P} + rollout.max_new_tokens={R} exceeds model."
                                 f"max_position_embeddings={self.cfg.max_position_embeddings}")
            length = round_up(P + R, LENGTH_MULTIPLE)  # the KV cache columns this call needs
            # prefill_width_multiple: columns of padding on the left, room for the prefill
            # sub-batches' rounded widths (never a longer cache than the call's own, nor past
            # max_position_embeddings); the returned prompts leave them out again
            lead = min(round_up(P, opts.prefill_width_multiple), length - R,
                       self.cfg.max_position_embeddings - R) - P
            if lead > 0:
                ids = torch.nn.functional.pad(ids, (lead, 0), value=pad_id)
                mask = torch.nn.functional.pad(mask, (lead, 0))
                P += lead
            # emulate_graphs: the graphed path's buckets and warm-ups off a GPU (tests)
            graphed = opts.cuda_graphs and (self.device.type == "cuda" or opts.emulate_graphs)
            mbs = cfg.max_batch_size
            chunks = [(s, min(s + mbs, N)) for s in range(0, N, mbs)]
            bucket = {c: bucket_for(c[1] - c[0], mbs) if graphed else c[1] - c[0]
                      for c in chunks}
            stop_ids = [eos_id, *cfg.stop_token_ids]
            key = (cfg.temperature, cfg.top_k, cfg.top_p, cfg.return_logprobs, tuple(stop_ids),
                   pad_id)
            targets = []  # compaction buckets (ascending), each below some chunk's bucket
            if opts.compact_finished_rows and R > 1:
                targets = [b for b in compaction.ladder(bucket_sizes(mbs), graphed=graphed,
                                                        min_graphed=opts.min_graphed_bucket)
                           if b < max(bucket.values())]
            ids_p, mask_p = ids.to(self.device), mask.to(self.device)  # (len(prompts), P)
            prompt_of_row = torch.arange(len(prompts),
                                         device=self.device).repeat_interleave(cfg.n)
            # one prefill per run of equal prompts: a prompt's n copies, and equal prompts side by
            # side (partial rollouts send a group's rows as n = 1 prompts)
            mask_np = mask.numpy()
            uniq, of_prompt = (_prefill_runs(ids.numpy(), mask_np) if opts.share_prefill
                               else (np.arange(len(prompts)),) * 2)
            lens = mask_np.sum(1)[uniq]  # (prefills,) on the host
            if len(uniq) < len(prompts):
                sel = torch.from_numpy(uniq).to(self.device)
                ids_u, mask_u = ids_p.index_select(0, sel), mask_p.index_select(0, sel)
            else:
                ids_u, mask_u = ids_p, mask_p
            of_row = np.repeat(of_prompt, cfg.n)  # row -> its prefill (host)
            prefill_of_row = torch.from_numpy(of_row).to(self.device)
            # a chunk's rows s..e-1 are copies of prefills of_row[s] .. of_row[e - 1]
            runs = {c: (int(of_row[c[0]]), int(of_row[c[1] - 1]) + 1) for c in chunks}
            self._ensure_cache(rows=max(bucket.values()), length=length,
                               fp8=cfg.kv_cache_dtype == "fp8")
            windows = kv_windows(self._cache.length, opts.kv_window)
            # every bucket a chunk may use, captured up front: warm-ups write the cache/buffers
            sizes = sorted(set(bucket.values()), reverse=True) + targets[::-1]
            steps = {b: self._step(b, R, key, cfg, opts, graphed, windows, record)
                     for b in dict.fromkeys(sizes)}
            # rollout.speculative: the tail's step (rollout/speculative.py); not while recording
            # the routed experts (its steps run the plain layers without recording)
            tail_step = (speculative.tail_step_for(self, R, cfg, opts, key, stop_ids, graphed)
                         if opts.spec_rows and record is None and R > 1 else None)
            self.reseed(seed)  # after any capture: warm-up runs consume randomness
            self.stats = _new_stats()
        with torch.no_grad():
            outs = [self._run_chunk(steps, bucket[c], ids_u[runs[c][0]:runs[c][1]],
                                    mask_u[runs[c][0]:runs[c][1]],
                                    prefill_of_row[c[0]:c[1]] - runs[c][0],
                                    lens[runs[c][0]:runs[c][1]], cfg, opts, pad_id, targets, record,
                                    tail_step, None if tail_step is None
                                    else [prompts[r // cfg.n] for r in range(*c)])
                    for c in chunks]
        with record_function("generate.finish"):
            tokens = torch.cat([o[0] for o in outs])  # (N, R)
            stop = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
            is_stop = (tokens[..., None] == stop).any(-1)  # the first stop is the real one
            lengths = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, R)  # (N,)
            width = max(int(lengths.max()), 1)
            resp_mask = (torch.arange(width, device=self.device) < lengths[:, None]).long()
            logprobs = None
            if cfg.return_logprobs:
                logprobs = torch.cat([o[1] for o in outs])[:, :width] * resp_mask
            prompt_experts = response_experts = None
            if record is not None:
                prompt_experts = torch.cat([o[2] for o in outs])
                response_experts = torch.cat([o[3] for o in outs])[:, :width]
        return RolloutBatch(prompt_ids=ids_p[:, lead:].index_select(0, prompt_of_row),
                            prompt_mask=mask_p[:, lead:].index_select(0, prompt_of_row),
                            response_ids=tokens[:, :width].masked_fill(resp_mask == 0, pad_id),
                            response_mask=resp_mask, group_ids=prompt_of_row,
                            indices=prompt_of_row.clone(), rollout_logprobs=logprobs,
                            prompt_experts=prompt_experts, response_experts=response_experts)

    def cache_bytes_for(self, prompt_lengths: list, cfg: RolloutConfig) -> int:
        """An upper bound of the KV cache bytes a call over prompts of these lengths with `cfg`
        allocates when this generator holds none yet: the largest graphed row bucket a chunk
        takes, and the columns of the longest prompt + max_new_tokens (+ multi-turn's scratch
        and lookahead columns), rounded up as the call rounds them."""
        rows = min(len(prompt_lengths) * cfg.n, cfg.max_batch_size)
        length = round_up(max(prompt_lengths, default=0) + cfg.max_new_tokens + 2, LENGTH_MULTIPLE)
        d = self.w.dims
        return kv_cache_nbytes(num_layers=d.num_layers, rows=bucket_for(rows, cfg.max_batch_size),
                               groups=d.groups, length=length, head_dim=d.head_dim,
                               dtype=self.dtype, fp8=cfg.kv_cache_dtype == "fp8")

    def weight_storages(self) -> frozenset:
        """Data pointers of the storages of every plain tensor the generator reads (those it
        aliases in place; a quantized matrix's codes are its own)."""
        return frozenset(t.untyped_storage().data_ptr() for t in decoder.weight_tensors(self.w)
                         if torch.is_tensor(t))

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this generator holds now (codes and scales of an fp8 one)."""
        return 0 if self._cache is None else self._cache.nbytes

    def reusable(self, params: dict) -> bool:
        """Whether a later call may keep this generator (and its KV cache and captured graphs) for
        `params`: its weights alias exactly these tensors' storage, so updates made in place since
        (the optimizer step) are seen and the graphs' addresses are still valid."""
        return self._aliased and self._param_ptrs == {n: t.data_ptr() for n, t in params.items()}

    def requantize(self, params: dict) -> None:
        """Quantized generators: rewrite the codes from `params` (the updated weights) in place."""
        if self.quantization != "none":
            requantize_weights_(self.w, decoder.load_weights(self.cfg, params, **self._load))

    def sampler_stream(self, opts: DecodeOptions) -> Optional[torch.Tensor]:
        """The fused sampler's device stream when `opts` ask for it (sampling.sample's
        `rng_state`), else None (the PyTorch sampler on `_rng`)."""
        return self._rng_state if opts.fused_sampler else None

    def reseed(self, seed: int) -> None:
        """Restart both sampling streams from `seed`: the torch Generator's and the fused
        sampler's (key = seed, counter 0), each in place (captured graphs keep reading them)."""
        from hybridflow.kernels.sample import seed_rng_state_

        self._rng.manual_seed(seed)
        seed_rng_state_(self._rng_state, seed)

    def release(self) -> None:
        """Free the KV cache, captured graphs and static buffers (not the weights)."""
        for _, fns in self._steps.values():
            for fn in fns.values():
                if isinstance(fn, GraphedStep):
                    fn.graph.reset()
        self._steps.clear()
        self._cache = self._tables = self._pool = self._side = None
        self._rng = torch.Generator(device=self.device)  # drops graph-registered RNG state too
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            free_workspaces()

    # ---- internals ----------------------------------------------------------------------------
    def _check_options(self, opts: DecodeOptions) -> None:
        if opts.kernels == "triton" and self.cfg.moe.enabled:
            raise ValueError("rollout.decode_kernels=triton: the Triton decode layers have no "
                             "mixture-of-experts MLP (model.moe); set rollout.decode_kernels=torch "
                             "or auto")
        if opts.kernels == "triton":
            _check_decode_kernels(self.device, self.w.dims.head_dim)
        if opts.compile and opts.kernels == "torch" and self.quantization != "none":
            raise ValueError(f"rollout.compile_decode=true with rollout.decode_kernels=torch does "
                             f"not compile quantized layers (rollout.quantization="
                             f"{self.quantization}); set rollout.compile_decode=false")
        if opts.compile and self.w.dims.tp_size > 1:
            raise ValueError(f"rollout.compile_decode=true needs a generation TP of 1 (got "
                             f"{self.w.dims.tp_size}): the compiled step has no TP all-reduces")

    def _padded_prompts(self, prompts, cfg: RolloutConfig, pad_id: int):
        """The prompts left-padded: (ids, mask) (len(prompts), longest) int64 on the host, after
        checking them and cfg."""
        lens = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        if not len(lens) or not lens.all():
            raise ValueError("generate needs a non-empty list of non-empty prompts (token ids)")
        # one pass over all the ids in numpy: a Python loop of per-prompt tensors is several times
        # slower, host time the GPU waits for at the start of every call
        flat = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64,
                           count=int(lens.sum()))
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= self.w.dims.true_vocab:
            raise ValueError(f"prompt token ids span [{lo}, {hi}], outside the vocabulary "
                             f"[0, {self.w.dims.true_vocab})")
        for key, ok in (("n", cfg.n >= 1), ("max_new_tokens", cfg.max_new_tokens >= 1),
                        ("max_batch_size", cfg.max_batch_size >= 1),
                        ("temperature", cfg.temperature >= 0), ("top_k", cfg.top_k >= 0),
                        ("top_p", 0 < cfg.top_p <= 1)):
            if not ok:
                raise ValueError(f"rollout.{key}={getattr(cfg, key)!r} is out of range")
        P = int(lens.max())
        mask = np.arange(P)[None, :] >= (P - lens)[:, None]  # each prompt ends at column P - 1
        ids = np.full(mask.shape, pad_id, dtype=np.int64)
        ids[mask] = flat  # row-major: each row's ids in order
        return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))

    def _ensure_cache(self, *, rows: int, length: int, fp8: bool = False) -> None:
        """A KV cache of at least rows x length (fp8: rollout.kv_cache_dtype=fp8's codes and
        scales), the present one when it fits and is of that kind."""
        if self._cache is not None and self._cache.fp8 == fp8:
            if self._cache.fits(rows=rows, length=length):
                return
            # grow: graphs captured on the old views must go
            rows, length = max(rows, self._cache.rows), max(length, self._cache.length)
        self.release()
        d = self.w.dims
        self._cache = KVCache(num_layers=d.num_layers, rows=rows, groups=d.groups, length=length,
                              head_dim=d.head_dim, dtype=self.dtype, device=self.device, fp8=fp8)
        self._tables = decoder.rope_tables(self.w.inv_freq, length, dtype=self.dtype,
                                           device=self.device)

    def _step(self, rows: int, max_new: int, key, cfg: RolloutConfig, opts: DecodeOptions,
              graphed: bool, windows: list, record: Optional[tuple] = None):
        """(buffers, {kv_len: step}) of one batch bucket: a decode step per attention window
        (`kv_windows`), all on the same buffers; kept per options (a graph captured under one
        DecodeOptions is never replayed under another) and per `record` ((L, k): the steps
        record the routed experts)."""
        k = (rows, max_new, key, graphed, tuple(windows), opts, record)
        if k in self._steps:
            return self._steps[k]
        buf = _Buffers(rows, self._cache.length, max_new, list(key[4]), self.device,
                       experts=record)
        fns = {kv_len: self._capture(self._step_fn(buf, cfg, opts, key[5], kv_len), buf,
                                     graphed and max_new > 1) for kv_len in windows}
        self._steps[k] = (buf, fns)
        return buf, fns

    def _capture(self, fn, buf: _Buffers, graphed: bool):
        if not graphed:
            return fn
        # warm-up runs (cuda_graph.WARMUP per window, all on this bucket's buffers) advance these:
        # keep the cache column inside every window and the output column inside max_new (> 1)
        buf.cur.zero_()
        buf.positions.zero_()
        buf.step.zero_()
        if self.device.type != "cuda":  # DecodeOptions.emulate_graphs
            return WarmedStep(fn)
        if self._pool is None:
            self._pool, self._side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        return GraphedStep(fn, pool=self._pool, side=self._side, generator=self._rng)

    def _step_fn(self, buf: _Buffers, cfg: RolloutConfig, opts: DecodeOptions, pad: int, kv_len):
        cache, (cos, sin), w = self._cache, self._tables, self.w
        # decode_kernels=triton: the bookkeeping after the draw as one kernel; greedy without
        # log-probs: the argmax's second pass runs in it
        step_kernel = opts.kernels == "triton"
        argmax_in_step = step_kernel and cfg.temperature == 0.0 and not cfg.return_logprobs
        if step_kernel:
            from hybridflow.kernels import next_token as ksampling
        max_new = buf.out_tokens.shape[1]
        rng_state = self.sampler_stream(opts)
        # finished rows' logits are discarded (pad emitted, log-prob 0, routing not recorded)
        own = buf.finished if opts.own_columns_only else None

        def step():
            logits = decoder.decode_step(w, buf.tokens, buf.positions, buf.cur, buf.key_valid,
                                         cache=cache, cos_tab=cos, sin_tab=sin, kv_len=kv_len,
                                         opts=opts, experts=buf.experts, finished=own)
            if buf.experts is not None:  # the fed token is response token step - 1; a row
                # that had finished fed its stop token or a post-stop sample: nothing to record
                routed = buf.experts.masked_fill(buf.finished[:, None, None], -1)
                # its column, step - 1, is in range for every real step (1..max_new-1); clamped
                # for the warm-ups before a capture, which run at step 0 (reset() then fills -1)
                col = (buf.step - 1).clamp_(0, max_new - 1)
                buf.out_experts.index_copy_(1, col, routed[:, None])
            tok = lp = partials = None
            if argmax_in_step:
                partials = ksampling.argmax_chunks(logits, pdl=opts.pdl)
            else:
                tok, lp = sample(logits, temperature=cfg.temperature, top_k=cfg.top_k,
                                 top_p=cfg.top_p, generator=self._rng,
                                 need_logprobs=cfg.return_logprobs, kernels=opts.kernels,
                                 pdl=opts.pdl, rng_state=rng_state,
                                 compile_backend=opts.compile_backend if opts.compile else None)
            if step_kernel:
                ksampling.advance_rows(
                    finished=buf.finished, out_tokens=buf.out_tokens, stop_ids=buf.stop_ids,
                    tokens=buf.tokens, positions=buf.positions, cur=buf.cur, step=buf.step,
                    pad=pad, tok=tok, partials=partials, vocab=logits.shape[1], lp=lp,
                    out_logprobs=None if lp is None else buf.out_logprobs, pdl=opts.pdl)
                return
            buf.out_tokens.index_copy_(1, buf.step, torch.where(buf.finished, pad, tok)[:, None])
            if lp is not None:
                buf.out_logprobs.index_copy_(1, buf.step, lp.masked_fill(buf.finished, 0)[:, None])
            buf.finished |= buf.is_stop(tok)
            buf.tokens.copy_(tok)  # finished rows feed their (valid) sample, never pad_id
            buf.positions.add_(1)
            buf.cur.add_(1)
            buf.step.add_(1)

        return step

    def _run_chunk(self, steps: dict, b: int, ids, mask, copy_of, lens, cfg: RolloutConfig,
                   opts: DecodeOptions, pad_id: int, targets: list, record: Optional[tuple],
                   tail_step: Optional[tuple] = None, row_prompts: Optional[list] = None):
        """Prefill the chunk's distinct prompts ids, mask (U, P) (their lengths `lens` (U,) on the
        host) once each, then decode their copies copy_of (B,) (chunk row -> row of ids) in
        bucket b (compacting into `targets`) -> (tokens (B, R), logprobs (B, R), and with `record`
        (L, k) the routed experts of the prompt (B, P, L, k) and response tokens (B, R, L, k);
        else None, None) before trimming. `tail_step` (rollout.speculative: speculative.py's
        (state, step)) decodes the tail from the chunk rows' prompts `row_prompts`."""
        (U, P), B = ids.shape, copy_of.shape[0]
        R = cfg.max_new_tokens
        with record_function("generate.prefill"):
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            cos, sin = self._tables
            pre = None if record is None else torch.full((U, P, *record), -1, dtype=torch.int16,
                                                         device=self.device)
            batches = prefill_batches(lens, opts.prefill_tokens, opts.prefill_width_multiple, P)
            # each sub-batch over its own widest prompt: its columns before P - width are padding
            last = torch.cat([decoder.forward(self.w, ids[r:e, P - n:], positions[r:e, P - n:],
                                              mask[r:e, P - n:].bool(), cos_tab=cos, sin_tab=sin,
                                              cache=self._cache, cache_row0=r, cache_col0=P - n,
                                              last_only=True, opts=opts,
                                              experts=None if pre is None else pre[r:e, P - n:])
                              for r, e, n in batches])  # (U, V), K/V in cache rows 0..U-1
            if pre is not None:  # left padding routes nothing
                pre = pre.masked_fill(mask[:, :, None, None] == 0, -1).index_select(0, copy_of)
            self.stats["prefills"] += len(batches)
            self.stats["prefill_rows"] += U
            if U < B:  # each copy gets its prompt's K/V and logits (n = 1: nothing to share)
                self._cache.gather_rows(copy_of, columns=P)
                last, mask = last.index_select(0, copy_of), mask.index_select(0, copy_of)
            tok, lp = sample(last, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                             generator=self._rng, need_logprobs=cfg.return_logprobs,
                             kernels=opts.kernels, pdl=opts.pdl,
                             rng_state=self.sampler_stream(opts))
            buf, fns = steps[b]
            buf.reset(tok=tok, lp=lp, lengths=mask.sum(1), mask=mask, pad_id=pad_id)
            out_tok = torch.full((B + 1, R), pad_id, dtype=torch.long, device=self.device)  # row B:
            out_lp = torch.zeros((B + 1, R), dtype=torch.float32, device=self.device)  # bucket pad
            out_exp = None if record is None else torch.full(
                (B + 1, R, *record), -1, dtype=torch.int16, device=self.device)
            row_map = torch.arange(b, device=self.device).clamp_(max=B)  # bucket row -> chunk row
            if self._poller is None:  # kept across calls (pinned buffers)
                self._poller = StopPoller(self.device)
            poller, full_b = self._poller, b
            poller.reset()
            tail = False
        with record_function("generate.decode"):
            for s in range(1, R):
                window = window_for(fns, P + s)
                fns[window]()  # the token of step s goes to cache column P + s - 1
                self.stats["decode_row_steps"] += b
                self.stats["decode_row_steps_uncompacted"] += full_b
                windows = self.stats["window_steps"]
                windows[window] = windows.get(window, 0) + 1
                if s % opts.check_every:
                    continue
                live = poller.poll((~buf.finished).sum())  # an upper bound of the rows live now
                if live == 0:
                    break
                if tail_step is not None and live is not None and live <= opts.spec_rows \
                        and s < R - 1:
                    # the tail by speculative steps (rollout/speculative.py): it flushes the
                    # bucket's outputs and writes the rest of the running rows' itself
                    with record_function("generate.spec_tail"):
                        speculative.run_tail(self, tail_step, buf, row_map, out_tok, out_lp,
                                             prompts=row_prompts, P=P, s=s,
                                             opts=opts, stats=self.stats)
                    tail = True
                    break
                new_b = None if live is None else compaction.target_bucket(live, b, targets)
                if new_b is not None:
                    compaction.flush(buf, row_map, out_tok, out_lp, out_exp)
                    row_map = compaction.compact(buf, steps[new_b][0], self._cache, row_map,
                                                 columns=P + s)
                    (buf, fns), b = steps[new_b], new_b
                    self.stats["compactions"] += 1
            if not tail:
                compaction.flush(buf, row_map, out_tok, out_lp, out_exp)
        return (out_tok[:B], out_lp[:B], pre, None if out_exp is None else out_exp[:B])


def _prefill_runs(ids: np.ndarray, mask: np.ndarray) -> tuple:
    """Left-padded prompts ids, mask (N, P) -> (the first prompt of each run of equal ones (U,),
    each prompt's run (N,)): a run is prefilled once."""
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ~((ids[1:] == ids[:-1]).all(1) & (mask[1:] == mask[:-1]).all(1))
    return np.flatnonzero(first), np.cumsum(first) - 1


def prefill_batches(lengths: np.ndarray, tokens: int, multiple: int = 1,
                    limit: Optional[int] = None) -> list:
    """Consecutive prefill sub-batches (start, end, width) of prompts of `lengths`: each takes
    prompts while their count times its width stays within `tokens` (one at least); a width is
    the widest of its prompts rounded up to `multiple` columns, at most `limit` (the padded
    prompts' width) and never below the widest prompt."""
    def width_of(longest: int) -> int:
        width = round_up(longest, multiple)
        return width if limit is None else max(longest, min(width, limit))

    out, r, n = [], 0, len(lengths)
    while r < n:
        e, longest = r + 1, int(lengths[r])
        while e < n and (e + 1 - r) * width_of(max(longest, int(lengths[e]))) <= tokens:
            longest = max(longest, int(lengths[e]))
            e += 1
        out.append((r, e, width_of(longest)))
        r = e
    return out


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def _new_stats() -> dict:
    return {"decode_row_steps": 0, "decode_row_steps_uncompacted": 0, "compactions": 0,
            "prefills": 0, "prefill_rows": 0, "window_steps": {},
            # rollout.speculative: tail steps, the rows they advanced (summed over steps), the
            # tokens drafted and the tokens emitted
            "spec_steps": 0, "spec_rows": 0, "spec_drafted": 0, "spec_tokens": 0}


def _check_decode_kernels(device: torch.device, head_dim: int) -> None:
    """rollout.decode_kernels=triton: triton, a CUDA device (or its CPU interpreter,
    TRITON_INTERPRET=1, as the tests run it) and a power-of-two head_dim >= 16."""
    from hybridflow.kernels import layer_ops as kern
    from hybridflow.kernels._dispatch import interpreting

    if not kern.HAVE_TRITON:
        raise ValueError("rollout.decode_kernels=triton needs the triton package (it ships with "
                         "CUDA builds of torch); set rollout.decode_kernels=torch")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"rollout.decode_kernels=triton needs a CUDA device (generation runs on "
                         f"{device.type}); set rollout.decode_kernels=torch")
    if not kern.head_dim_supported(head_dim):
        raise ValueError(f"rollout.decode_kernels=triton needs a power-of-two head_dim >= 16 "
                         f"(the model has {head_dim}); set rollout.decode_kernels=torch")


def kv_windows(length: int, window: int) -> list:
    """The attention lengths of the decode steps over a cache of `length` columns: the multiples of
    `window` below it and `length` itself, or [None] (the whole cache, unsliced) for window 0."""
    if not window or window >= length:
        return [None]
    return [*range(window, length, window), length]


def window_for(fns: dict, columns: int):
    """The key of the shortest window holding `columns` cache columns."""
    if None in fns:
        return None
    return min(w for w in fns if w >= columns)
