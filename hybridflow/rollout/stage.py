"""The trainer's rollout and reward stages: reshard -> generate -> RolloutBatch, and scoring.

Generation runs on the gen layout (TP_g x 1 x DP_g) with weights the Resharder gathers from the
training shards (no second model); when TP_g == TP_t and PP_t == 1 the training parameters are used
as they are. Groups, layouts and replica indices come from the ParallelContext. The gen layout has more replicas than training: inside one training model-parallel group
(the TP_t x PP_t ranks of a DP replica) there are k = PP_t * TP_t / TP_g gen replicas. The DP replica's
prompts are split into k chunks, gen replica j generates chunk j, and the chunks are all-gathered over
the model-parallel group, so every rank of the DP replica ends with the same full batch (chunk sizes
differ by at most one; with fewer prompts than gen replicas, every gen replica generates all of them
with the same seed instead). Sequence scores come from the rule reward (decoded text) and/or
the reward model (scalar head at the last response token). With rollout.multi_turn.enable the
rows are multi-turn trajectories with tool calls (rollout/multi_turn.py): the rule reward reads the
whole response text, tool results included, and the turn/tool metrics join the reward metrics.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack

import torch
import torch.distributed as dist

from hybridflow import watchdog
from hybridflow.config import Config, micro_batching
from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel.context import ParallelContext
from hybridflow.parallel.dp import dp_max, dp_sum, gather_batches
from hybridflow.reward import compute_rule_rewards, get_reward_fn
from hybridflow.models.lora import is_adapter_name, merged_adapters
from hybridflow.rollout.generator import Generator
from hybridflow.rollout.options import DecodeOptions
from hybridflow.rollout.speculative import speculative_metrics


def _left_pad(rows: list[list[int]], pad_id: int, width: int):
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


class RolloutStage:
    def __init__(self, cfg: Config, ctx: ParallelContext, actor, tokenizer, reward_engine=None):
        self.cfg, self.ctx, self.actor, self.tok = cfg, ctx, actor, tokenizer
        self.reward_fn = get_reward_fn(cfg.reward.fn) if cfg.reward.fn is not None else None
        self.reward_engine = reward_engine
        self.resharder = None
        if ctx.reshard is not None:
            from hybridflow.parallel.reshard import Resharder

            self.resharder = Resharder(actor.module, layout=ctx.layout, groups=ctx.reshard)
        self._kept: Generator | None = None  # across steps with rollout.free_cache_engine=false
        self._pool: ThreadPoolExecutor | None = None  # reward.launch_reward_fn_async's worker
        # actor.router_replay=R3: the generator records each token's experts for the training passes
        self.record_experts = cfg.actor.router_replay == "R3" and cfg.model.moe.enabled
        self.tools = None  # rollout.multi_turn: the tool runner (hybridflow/rollout/multi_turn.py)
        # the last generation's own metrics (multi-turn: turns, tools; rollout.speculative: the
        # tail's steps and drafts), merged into score's
        self.turn_metrics: dict = {}
        if cfg.rollout.multi_turn.enable:
            from hybridflow.tools.runner import ToolRunner
            from hybridflow.tools import load_tool_config
            from hybridflow.tools.formats import ToolFormat

            m = cfg.rollout.multi_turn
            tools = load_tool_config(m.tool_config_path)
            self.tools = ToolRunner(tools, fmt=ToolFormat(m.format, tokenizer=tokenizer,
                                                           tools=tools), tokenizer=tokenizer, mt=m)
        # actor.offload_params: bring the actor's weights back (prefetched) after generation or,
        # with a reward model, after scoring; the trainer sets it false when no pass before the
        # critic's reads them (Trainer._plan_param_offload)
        self.params_back_after_gen = True
        self._quantized_at = None  # (step, round) the kept generator's codes were made for
        # bytes of the last generator's quantized weights (rollout.quantization; 0: none) and of
        # its KV cache at the end of the last call (rollout.kv_cache_dtype=fp8: codes + scales)
        self.quantized_bytes = self.kv_cache_bytes = 0
        if not cfg.rollout.free_cache_engine and self.resharder is not None and ctx.rank == 0:
            print("hybridflow: warning: rollout.free_cache_engine=false does little with "
                  "resharding (rollout.tensor_parallel_size != parallel.tensor_parallel_size or "
                  "PP > 1): the gathered weights are re-allocated every step, and the generator "
                  "is kept only for a step whose weights come back at the same addresses",
                  flush=True)

    def _gen_params(self):
        if self.resharder is None:
            params = {n: p for n, p in self.actor.module.named_parameters()
                      if not is_adapter_name(n)}
            if self.cfg.model.moe.enabled:  # every expert, this TP_g rank's shards
                from hybridflow.parallel.reshard import generation_params

                params = generation_params(params, self.ctx, self.cfg.model)
            return params
        return self.resharder.gather()

    def generate(self, items, *, step: int, timer, rollout_cfg=None, seed=None,
                 round_index: int = 0, record_experts: bool | None = None,
                 step_metrics: bool = True) -> RolloutBatch:
        """Sample `rollout_cfg.n` (default: the rollout config's) responses for this DP rank's
        `items`; every rank of the DP replica returns the same rows, on the CPU.
        `record_experts` (None: as actor.router_replay asks): the rows carry their routing.
        `step_metrics` false (validation): the call's own metrics (the speculative tail's) stay
        out of the training step's."""
        r = rollout_cfg or self.cfg.rollout
        ctx = self.ctx
        # chunk j of the DP replica's prompts for gen replica j (sizes differ by at most one)
        k, j = ctx.num_gen_replicas, ctx.gen_replica
        split = k > 1 and len(items) >= k
        if seed is None:
            seed = self.cfg.trainer.seed * 1_000_003 + step * 1009 + ctx.train.dp
            seed += round_index * 1_000_000_007  # dynamic sampling's later rounds of one step
        mine = items
        if split:
            base, extra = divmod(len(items), k)
            start = j * base + min(j, extra)
            mine = items[start:start + base + (j < extra)]
            seed += 7919 * j
        away = self.offloads_in_gen(r.quantization)
        # actor.offload_params with a quantized rollout in place: the matrices go to the host
        # first and are quantized one at a time from there (never all on the device with codes)
        streamed = away and self.resharder is None
        with ExitStack() as stack:
            with timer("reshard"):  # LoRA: adapters merged into the weights, restored on exit
                self.actor.params_to_device()  # actor.offload_params: the switch reads them
                merge = stack.enter_context(ExitStack())
                fetch = None
                if streamed:
                    params, fetch = self._streamed_params()
                else:
                    merge.enter_context(merged_adapters(self.actor.module))
                    params = self._gen_params()
            if self.resharder is not None:
                stack.callback(self.resharder.release)
            with timer("gen"):
                gen = self._generator(params, r.quantization, step, fetch,
                                      lengths=[len(it.prompt_ids) for it in mine], rollout_cfg=r)
                self.quantized_bytes = gen.quantized_bytes
                if away and not streamed:  # the generator holds its own matrices: the
                    merge.close()  # training weights may go (LoRA: unmerged first; the host
                    self.actor.params_to_host(keep=gen.weight_storages())  # copy is the base)
                with torch.no_grad():
                    if self.tools:
                        batch = self._multi_turn(gen, mine, r, seed)
                    else:
                        batch = gen.generate(
                            [it.prompt_ids for it in mine], cfg=r,
                            eos_id=-1 if r.ignore_eos else self.tok.eos_id,
                            pad_id=self.tok.pad_id, seed=seed,
                            options=DecodeOptions.from_config(r),
                            record_experts=self.record_experts
                            if record_experts is None else record_experts)
                self.kv_cache_bytes = gen.kv_cache_bytes
                if r.speculative.enable is True and not self.tools and step_metrics:
                    speculative_metrics(gen.stats, into=self.turn_metrics)
                if self._kept is not gen:
                    gen.release()
                del gen
                if away and self.params_back_after_gen and self.reward_engine is None:
                    self.actor.params_to_device(prefetch=True)  # behind the rule reward
                batch = batch.to("cpu")
                if split:
                    batch = self._gather_replicas(batch)
        first = ctx.train.dp * len(items)  # global prompt ids: DP rank r holds prompts r*L ..
        group_ids = (first + torch.arange(len(items))).repeat_interleave(r.n)
        indices = torch.tensor([it.index for it in items]).repeat_interleave(r.n)
        return dataclasses.replace(batch, group_ids=group_ids, indices=indices)

    def offloads_in_gen(self, quantization: str) -> bool:
        """actor.offload_params: whether the training weights leave the device while decoding,
        which they can when the generator holds its own copy of the decoder's matrices (gathered
        into the generation layout, or quantized; not for MoE, whose experts are gathered in
        place). Then only the storages the generator reads (norms, embedding, LM head, and
        whatever it aliases) stay."""
        return (self.actor.offloads_params and not self.cfg.model.moe.enabled
                and (self.resharder is not None or quantization != "none"))

    def _streamed_params(self):
        """(params, fetch) for a quantized Generator built from the host: the decoder's matrices
        offloaded (their host copies in `params`), everything else on the device; `fetch` brings
        one matrix over, with its LoRA update merged in as `merged_adapters` would (same bits)."""
        from hybridflow.models.lora import LoRAAdapter, merged_copy
        from hybridflow.rollout.quantize import MATRIX_LINEARS

        actor = self.actor
        named = self._gen_params()
        suffixes = tuple(f".{path}.weight" for path in MATRIX_LINEARS.values())
        actor.params_to_host(keep=frozenset(p.untyped_storage().data_ptr()
                                            for n, p in named.items() if not n.endswith(suffixes)))
        lora = {name: m._modules["lora"] for name, m in actor.module.named_modules()
                if isinstance(m._modules.get("lora"), LoRAAdapter) and m._modules["lora"].enabled}
        device, dtype = actor.device, actor.tcfg.params_dtype

        def fetch(i: int, field: str, t: torch.Tensor) -> torch.Tensor:
            dev = t.to(device=device, dtype=dtype, non_blocking=True)
            adapter = lora.get(f"decoder.layers.{i}.{MATRIX_LINEARS[field]}")
            return dev if adapter is None else merged_copy(adapter, dev, inplace=dev is not t)

        return {n: actor.host_view(p) for n, p in named.items()}, fetch

    def _multi_turn(self, gen: Generator, items, r, seed: int) -> RolloutBatch:
        from hybridflow.rollout.multi_turn import generate_multi_turn

        batch, self.turn_metrics = generate_multi_turn(
            gen, [it.prompt_ids for it in items], cfg=r, runner=self.tools,
            eos_id=-1 if r.ignore_eos else self.tok.eos_id, pad_id=self.tok.pad_id, seed=seed,
            options=DecodeOptions.from_config(r))
        return batch

    def _generator(self, params: dict, quantization: str, step: int, fetch=None, *,
                   lengths: list = (), rollout_cfg=None) -> Generator:
        """A new Generator over `params` (quantized per `quantization`: once per step, at this
        train -> generation switch), or with rollout.free_cache_engine=false the one kept from an
        earlier step when it still aliases these weights (its cache and graphs stay valid; its
        quantized weights rewritten in place from them once per step).
        Only a generator of the training rollout's quantization is kept. A call of another one
        (validation with trainer.val_quantized=false) gets a generator of its own, freed after the
        call, beside the kept one while every rank's device has room for its KV cache (prompts
        of `lengths`, `rollout_cfg`); otherwise the kept one is freed first, on every rank."""
        kept = self._kept
        training_kind = quantization == self.cfg.rollout.quantization
        if kept is not None:  # (a generator built from the host is never kept)
            usable = fetch is None and kept.reusable(params)
            if self.resharder is not None:  # gathered buffers: each rank's allocator decides
                usable = _on_every_rank(usable)  # where; every rank alike
            if usable and kept.quantization == quantization:
                if self._quantized_at != step:
                    kept.requantize(params)
                    self._quantized_at = step
                return kept
            if not usable or training_kind:
                kept.release()
                self._kept = kept = None
        gen = Generator(model_cfg=self.actor.model_cfg, params=params,
                        tp_group=self.ctx.gen_tp_group, device=self.actor.device,
                        dtype=self.actor.tcfg.params_dtype, true_vocab_size=self.actor.vocab_limit,
                        quantization=quantization, fetch=fetch)
        if not training_kind:  # another quantization's call, beside the kept generator if any
            room = kept is None or _room_for(
                gen.cache_bytes_for(list(lengths), rollout_cfg or self.cfg.rollout),
                self.actor.device)
            # one decision for every rank (each calls here: the quantization is the config's), so
            # no rank rebuilds, and captures with its collectives, alone at the next step
            if not _on_every_rank(room) and kept is not None:
                kept.release()
                self._kept = None
            return gen
        if not self.cfg.rollout.free_cache_engine and fetch is None and gen.reusable(params):
            self._kept, self._quantized_at = gen, step
        return gen

    def release(self) -> None:
        """Free a generator kept across steps (rollout.free_cache_engine=false)."""
        if self._kept is not None:
            self._kept.release()
            self._kept = None
        if self.tools is not None:
            self.tools.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _gather_replicas(self, batch: RolloutBatch) -> RolloutBatch:
        """Concatenate the gen replicas' chunks, in replica order, on every model-parallel rank.
        Every rank of a replica holds the same chunk: the one with gen TP rank 0 speaks for it."""
        ctx = self.ctx
        chunks = gather_batches(batch, group=ctx.mp_group, pad_id=self.tok.pad_id)
        leaders = {}
        for g, rank in enumerate(dist.get_process_group_ranks(ctx.mp_group)):
            if ctx.layout.gen_coord(rank).tp == 0:
                leaders[ctx.layout.replica_in_model_parallel_group(rank)] = chunks[g]
        assert sorted(leaders) == list(range(ctx.num_gen_replicas))
        return RolloutBatch.cat([leaders[i] for i in range(ctx.num_gen_replicas)],
                                pad_id=self.tok.pad_id)

    def score(self, items, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        scores, metrics = torch.zeros(batch.batch_size), {}
        if self.reward_fn is not None:
            scores, metrics = self.rule_scores(items, batch)
        return self.finish_scores(batch, scores, metrics)

    def score_async(self, items, batch: RolloutBatch) -> "PendingScores":
        """reward.launch_reward_fn_async: the rule reward of `batch` scored on a worker thread
        (no collective, no device work there); `.result()` waits and returns score()'s value."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        return PendingScores(self, batch, self._pool.submit(self.rule_scores, items, batch))

    def score_deferred(self, items, batch: RolloutBatch) -> "PendingScores":
        """reward.score_in_pass: the rule reward of `batch` scored on the calling thread when its
        `run()` is called (the trainer hands it to the next forward-only pass as host work);
        `.result()` runs it if nothing did and returns score()'s value."""
        return PendingScores(self, batch, lambda: self.rule_scores(items, batch))

    def finish_scores(self, batch: RolloutBatch, scores: torch.Tensor,
                      metrics: dict) -> tuple[torch.Tensor, dict]:
        """The reward model's scores added to the rule's, the rollout's turn metrics, and every
        metric averaged over the DP ranks (collectives: on the main thread)."""
        if self.reward_engine is not None:
            self.actor.params_to_host()  # actor.offload_params: not read by the reward model
            rm = self.reward_engine.compute_scores(
                batch, **micro_batching(self.cfg.algo, forward=True))
            if self.params_back_after_gen:
                self.actor.params_to_device(prefetch=True)
            metrics["reward/model_score/mean"] = float(rm.mean())
            scores = scores + self.cfg.reward.model_weight * rm
        metrics.update(self.turn_metrics)  # multi-turn: turns, tool calls/errors, tool time
        self.turn_metrics = {}
        dp = self.ctx.dp_size  # every DP rank holds the same number of rows
        return scores, {k: dp_sum(v, group=self.ctx.dp_group) / dp
                        for k, v in sorted(metrics.items())}

    def rule_scores(self, items, batch: RolloutBatch, fn=None) -> tuple[torch.Tensor, dict]:
        n = batch.batch_size // len(items)
        rows = [items[i // n] for i in range(batch.batch_size)]
        lengths = batch.response_mask.sum(1).tolist()
        texts = self.tok.decode_batch([batch.response_ids[i, :k].tolist()  # not the padding
                                       for i, k in enumerate(lengths)])
        scores, extra = compute_rule_rewards(
            fn or self.reward_fn, prompts=[it.prompt_text for it in rows], responses=texts,
            ground_truths=[it.ground_truth for it in rows],
            extra_infos=[it.extra_info for it in rows], indices=[it.index for it in rows],
            data_sources=[it.data_source for it in rows])
        metrics = {f"reward/{k}/mean": sum(v) / len(v) for k, v in extra.items()}
        return torch.tensor(scores, dtype=torch.float32), metrics

    def sft_batch(self, items) -> RolloutBatch:
        """Prompt + reference response (`extra_info.sft_response`) + EOS, as a RolloutBatch."""
        responses = []
        for it in items:
            ref = (it.extra_info or {}).get("sft_response")
            if ref is None:
                raise ValueError(f"trainer.sft_warmup_steps > 0 needs extra_info.sft_response in "
                                 f"every record; record {it.index} has none")
            responses.append(self.tok.encode(ref) + [self.tok.eos_id])
        p_ids, p_mask = _left_pad([it.prompt_ids for it in items], self.tok.pad_id,
                                  max(len(it.prompt_ids) for it in items))
        width = max(len(r) for r in responses)
        r_ids = torch.full((len(items), width), self.tok.pad_id, dtype=torch.long)
        r_mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, r in enumerate(responses):
            r_ids[i, :len(r)] = torch.tensor(r)
            r_mask[i, :len(r)] = 1
        idx = torch.tensor([it.index for it in items])
        return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids,
                            response_mask=r_mask, group_ids=idx, indices=idx)


class PendingScores:
    """A step's rule reward not on its batch yet: scored on the stage's worker thread
    (RolloutStage.score_async: `work` is a Future) or on the thread that calls `run()`
    (score_deferred: `work` is the call). `result()` waits for it, or runs it, then finishes it
    as score() does (on the calling thread); the host seconds of a deferred one that `run()`
    scored (inside a pass) are the metric perf/reward_in_pass_s."""

    def __init__(self, stage: "RolloutStage", batch: RolloutBatch, work):
        self.stage, self.batch, self.work = stage, batch, work
        self.scored = None  # a deferred one's (scores, metrics) once run

    @property
    def deferred(self) -> bool:
        return not isinstance(self.work, Future)

    def run(self) -> None:
        if self.deferred and self.scored is None:
            t0 = time.perf_counter()
            with watchdog.stage("reward"):  # a failing rule names its stage, not the pass's
                scores, metrics = self.work()
            self.scored = scores, {**metrics, "perf/reward_in_pass_s": time.perf_counter() - t0}

    def result(self) -> tuple[torch.Tensor, dict]:
        if self.deferred:
            scores, metrics = self.scored if self.scored is not None else self.work()
        else:
            scores, metrics = self.work.result()
        return self.stage.finish_scores(self.batch, scores, metrics)


# what a generator beside the kept one takes besides its KV cache (captured graphs' pools,
# workspaces), as a share of that cache and a floor
_BESIDE_KEPT_SLACK, _BESIDE_KEPT_FLOOR = 0.25, 512 * 2**20


def _on_every_rank(flag: bool) -> bool:
    """`flag` and-ed over every rank of the job (dp_max over the world group)."""
    return not dp_max(float(not flag), group=None)


def _room_for(cache_bytes: int, device: torch.device) -> bool:
    """Whether `device` has room for a second generator's KV cache of `cache_bytes` (free memory
    and what PyTorch's allocator holds unused; any CPU has)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return cache_bytes * (1 + _BESIDE_KEPT_SLACK) + _BESIDE_KEPT_FLOOR <= free + unused
