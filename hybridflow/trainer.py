"""The RL step as a list of stages, each under its named timer (verl's names):

  prompts -> reshard (train -> gen layout) -> gen -> reward -> old_log_prob -> ref -> values -> adv
          -> update_critic -> update_actor -> metrics / checkpoint -> val (every trainer.val_every)

With dynamic sampling (DAPO) the first three repeat on fresh prompts until enough groups have scores
that differ (hybridflow/rollout/dynamic_sampling.py); the overlong penalty is added after that filter.
old_log_prob is left out (no timer; actor/old_log_prob_skipped = 1) when one actor update is the step's
only one (hybridflow.algo.on_policy): its forward gives pi_old and, afterwards, the mismatch metrics.

Every rank runs this same code. Each DP rank generates for its own prompts; ranks of one
model-parallel group generate identical samples (same seed) so the batch they train on agrees.
Advantages are computed on the global batch (gathered over DP), so whitening and group statistics do
not depend on the DP size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
from typing import Optional

import torch
import torch.distributed as dist

from hybridflow import components
from hybridflow.parallel.context import ParallelContext
from hybridflow.rollout.stage import PendingScores, RolloutStage
from hybridflow.run_state import Checkpointer, train_data_record
from hybridflow.algo import (apply_kl_penalty, build_kl_controller, get_advantage_estimator,
                             overlong_penalty, batch_mismatch_metrics)
from hybridflow.algo.objectives import actor_objective, critic_objective, sft_objective
from hybridflow.algo.on_policy import old_log_prob_note, skip_old_log_prob
from hybridflow.config import Config, TrainerConfig, micro_batching
from hybridflow.config_auto import resolve_for_run
from hybridflow.data.batch import RolloutBatch
from hybridflow.engine import AdapterFreeReference
from hybridflow.gpu_monitor import GpuMonitor
from hybridflow.metrics import MetricsLogger, StageTimer, memory_metrics
from hybridflow.nonfinite import SkippedUpdates
from hybridflow.parallel.balance import balance_rows
from hybridflow.parallel.dp import all_gather_batch, dp_max, dp_sum
from hybridflow.rollout.dynamic_sampling import chunking_warning, fill_informative
from hybridflow.rollout.partial import (PartialRollouts, batch_size_warning, gather_state,
                                        restore as restore_partial, row_items)

# Engine.train_step metrics logged under the role (`actor/grad_norm`, ...); the rest carry their own
ROLE_METRICS = ("grad_norm", "lr", "update_skipped", "graphed_micro_batch_frac")


class Trainer:
    def __init__(self, cfg: Config, ctx: ParallelContext):
        cfg = resolve_for_run(cfg, ctx)  # the auto (null) options, decided for this device
        self.cfg, self.ctx = cfg, ctx
        self.tokenizer, self.dataset, self.tokenizer_path = components.build_tokenizer_and_dataset(cfg)
        self.sampler = components.build_sampler(cfg, ctx, self.dataset)
        self.train_data = train_data_record(cfg.data, num_rows=len(self.dataset))  # checkpointed
        self.engines = components.build_engines(cfg, ctx)
        components.finalize_engines(self.engines, self.tokenizer)
        self.actor = self.engines["actor"]
        self.ref = components.reference_policy(cfg, self.engines)
        self.critic = self.engines.get("critic")
        if self.ref is not None and cfg.trainer.offload_ref:
            self.ref.offload()
        self.rollout = RolloutStage(cfg, ctx, self.actor, self.tokenizer,
                                    reward_engine=self.engines.get("reward"))
        self.validator = components.build_validator(cfg, ctx, rollout=self.rollout,
                                                    tokenizer=self.tokenizer)
        a = cfg.algo
        self.kl_ctrl = build_kl_controller(a.kl_ctrl, kl_coef=a.kl_coef, target_kl=a.target_kl,
                                           horizon=a.kl_horizon)
        self.estimator = get_advantage_estimator(a.adv_estimator)
        # log-probs are scored at the sampling temperature (greedy sampling scores at T = 1)
        self.temperature = cfg.rollout.temperature or 1.0
        self.step = 0
        self.step_lengths = None  # the last step's trained response lengths (rollout_lengths.jsonl)
        self.sft_done = cfg.trainer.sft_warmup_steps == 0
        # dynamic sampling's informative fraction of the last step (sizes adaptive rounds)
        self.kept_estimate = None
        # rollout.partial: the groups in flight on this DP rank, and drawn prompts not yet in flight
        pc = cfg.rollout.partial
        self.partial = PartialRollouts(
            n=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
            stop_ids=[*([] if cfg.rollout.ignore_eos else [self.tokenizer.eos_id]),
                      *cfg.rollout.stop_token_ids],
            max_decode_steps=pc.max_decode_steps, max_staleness=pc.max_staleness,
            local_groups=self.sampler.local_batch_size,
            local_extra=pc.extra_prompts // ctx.dp_size) if pc.enable else None
        self.partial_queue: list = []
        self.skipped = SkippedUpdates(output_dir=cfg.trainer.output_dir, rank=dist.get_rank(),
                                      max_skipped_steps=cfg.trainer.max_skipped_steps)
        self.checkpointer = Checkpointer(self)
        if self.checkpointer.maybe_resume() and dist.get_rank() == 0:
            print(f"resumed from {self.checkpointer.root} at step {self.step} of "
                  f"{cfg.trainer.total_steps} (trainer.resume=false starts over)", flush=True)
        self.logger = MetricsLogger(cfg.trainer.output_dir, total_steps=cfg.trainer.total_steps,
                                    enabled=dist.get_rank() == 0,
                                    tensorboard=cfg.trainer.tensorboard,
                                    progress_bar=cfg.trainer.progress_bar, start_step=self.step)
        # the SM clock, power and temperature of this rank's GPU per stage (trainer.gpu_monitor_*)
        self.gpu_monitor = GpuMonitor.for_device(
            cfg.trainer.gpu_monitor_interval_s, ctx.device.index or 0,
            asked=(cfg.trainer.gpu_monitor_interval_s != TrainerConfig.gpu_monitor_interval_s
                   and dist.get_rank() == 0))
        # consumers of every step's metrics besides the logger; on_step returning True ends the run
        self.step_consumers = components.build_step_consumers(cfg, start_step=self.step)
        if cfg.algo.skip_redundant_old_log_prob:
            self.logger.print(old_log_prob_note(cfg, start_step=self.step))
        ds = cfg.algo.dynamic_sampling
        note = ds.enable and chunking_warning(
            batches_per_round=ds.batches_per_round, local_prompts=self.sampler.local_batch_size,
            n=cfg.rollout.n, gen_replicas=ctx.num_gen_replicas,
            max_batch_size=cfg.rollout.max_batch_size)
        if note:
            self.logger.print(note)
        note = self.partial is not None and batch_size_warning(
            local_groups=self.partial.local_groups, local_extra=self.partial.local_extra,
            n=cfg.rollout.n, gen_replicas=ctx.num_gen_replicas,
            max_batch_size=cfg.rollout.max_batch_size)
        if note:
            self.logger.print(note)
        note = self.actor.offloads_params and offload_params_note(self)
        if note:
            self.logger.print(note)

    # ----------------------------------------------------------------- loop
    def train(self) -> list[dict]:
        history = []
        t = self.cfg.trainer
        if t.val_only:  # score this model as it is (see TrainerConfig.val_only)
            metrics = self.validate()
            self.logger.log(self.step, metrics)
            self.logger.close()
            if self.gpu_monitor is not None:
                self.gpu_monitor.close()
            return [metrics]
        if not self.sft_done:
            self.sft_warmup()
        if self.step == 0 and self.validator is not None and self.validator.due(0):
            self.logger.log(0, self.validate())
        stopped, save = False, t.save_final
        with manual_gc(t.gc_interval > 0):
            while self.step < t.total_steps and not stopped:
                metrics = self.train_step()
                self.step += 1
                if self.validator is not None and self.validator.due(self.step):
                    metrics.update(self.validate())
                self.logger.log(self.step, metrics)
                self.logger.log_lengths(self.step, self.step_lengths)
                for c in self.step_consumers:  # those that take the step's response lengths
                    if hasattr(c, "on_lengths"):
                        c.on_lengths(self.step, self.step_lengths)
                history.append(metrics)
                stoppers = [c for c in self.step_consumers if c.on_step(self.step, metrics)]
                stopped = bool(stoppers)
                if stopped:
                    save = all(c.save_on_stop for c in stoppers)
                final = (self.step == t.total_steps or stopped) and save  # saved below
                if t.save_every and self.step % t.save_every == 0 and not final:
                    self.checkpointer.save()
        for c in self.step_consumers:
            c.on_end()
        if self.gpu_monitor is not None:
            self.gpu_monitor.close()
        self.rollout.release()  # a generator kept across steps (rollout.free_cache_engine=false)
        if save:
            self.checkpointer.save()
        self.logger.summary(history, first_step=self.step - len(history) + 1)
        self.logger.close()
        return history

    def validate(self) -> dict:
        timer = StageTimer()
        with timer("val"):
            metrics = self.validator.run(step=self.step, timer=StageTimer())
        return {**metrics, **timer.metrics()}

    def train_step(self) -> dict:
        cfg, timer = self.cfg, StageTimer()
        with timer("step"):
            if (self.ref is not None and cfg.trainer.offload_ref
                    and cfg.trainer.offload_ref_prefetch):
                self.ref.onload(prefetch=True)  # behind generation; the ref pass waits for it
            skip_old, _ = skip_old_log_prob(cfg, step=self.step)  # then set by update_actor
            away = self._plan_param_offload(skip_old)
            generation = gc_generation(self.step, cfg.trainer.gc_interval,
                                       cfg.trainer.gc_full_interval)
            if generation is not None:
                with timer("gc"):
                    gc.collect(generation)
            batch, reward_metrics = self.generate_and_score(timer)
            pending = reward_metrics if isinstance(reward_metrics, PendingScores) else None
            if cfg.trainer.balance_batch and self.ctx.dp_size > 1:
                if pending is not None:  # the scores move with their rows
                    reward_metrics, pending = self.scores_ready(batch, pending, timer), None
                with timer("balance"):
                    batch, balance_metrics = balance_rows(
                        batch, group=self.ctx.dp_group, rank=self.ctx.train.dp,
                        parts=self.ctx.dp_size, pad_id=self.tokenizer.pad_id)
                reward_metrics.update(balance_metrics)
            batch = batch.trimmed()
            fwd = micro_batching(cfg.algo, forward=True)
            # reward.score_in_pass: the rule scored here while the device runs the first
            # forward-only pass below (handed to it as host work; else before the advantages)
            in_pass = iter([pending.run] if pending is not None and pending.deferred else [])
            replay_metrics, pass_metrics = {}, {}
            if not skip_old:
                with timer("old_log_prob"):
                    batch.old_logprobs = self.actor.compute_logprobs(
                        batch, temperature=self.temperature, host_work=next(in_pass, None),
                        **fwd)
                # actor.router_replay: routing decisions replay changed (pi_old's weights are
                # the rollout's: the generation/training router mismatch itself)
                replay_metrics = self.actor.replay_metrics("moe/router_mismatch_frac")
            if "ref" in away:
                self.actor.params_to_host()
            if self.ref is not None:
                with timer("ref"):
                    if cfg.trainer.offload_ref:
                        self.ref.onload()
                    batch.ref_logprobs = self.ref.compute_logprobs(
                        batch, temperature=self.temperature, host_work=next(in_pass, None),
                        **fwd)
                    if cfg.trainer.offload_ref:
                        self.ref.offload()
                pass_metrics.update(pass_shape_metrics("ref", self.ref))
            if "critic" in away:
                self.actor.params_to_host()
            elif away:  # back behind the advantages (the update would wait for them anyway)
                self.actor.params_to_device(prefetch=True)
            if self.critic is not None:
                with timer("values"):
                    batch.values = self.critic.compute_values(
                        batch, host_work=next(in_pass, None), **fwd)
            if pending is not None:
                reward_metrics = self.scores_ready(batch, pending, timer)
            with timer("adv"):
                batch, adv_metrics = self.compute_advantages(batch)
            update_metrics = {}
            if self.critic is not None:
                with timer("update_critic"):
                    update_metrics.update(self.update(self.critic, batch, critic_objective))
            if self.step >= cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    update_metrics.update(self.update(self.actor, batch, actor_objective,
                                                      on_policy=skip_old))
                pass_metrics.update(pass_shape_metrics("update_actor", self.actor))
            if skip_old and batch.rollout_logprobs is not None:  # from update_actor's forward
                full = all_gather_batch(_without_experts(batch), group=self.ctx.dp_group,
                                        pad_id=self.tokenizer.pad_id)
                update_metrics.update(batch_mismatch_metrics(full, cap=cfg.algo.tis_imp_ratio_cap))
            self.skipped.end_step(self.step + 1)
            self.actor.params_to_device()  # a checkpoint or validation may follow
            self.rollout.params_back_after_gen = True
        update_metrics["actor/old_log_prob_skipped"] = float(skip_old)
        metrics = {**reward_metrics, **replay_metrics, **adv_metrics, **update_metrics,
                   **pass_metrics, **timer.metrics(), **memory_metrics()}
        if self.actor.offloads_params:  # the most of the actor's weights off the GPU at once
            metrics["perf/actor_weights_offloaded_gb"] = (
                self.actor.params_offloaded_most_bytes() / 2**30)
        if cfg.rollout.quantization != "none":  # the generator's codes + scales (freed with it)
            metrics["perf/rollout_quantized_weights_gb"] = self.rollout.quantized_bytes / 2**30
        metrics["perf/kv_cache_gb"] = self.rollout.kv_cache_bytes / 2**30
        if self.gpu_monitor is not None:
            metrics.update(self.gpu_monitor.step_metrics(timer.spans))
        metrics.update(self.throughput(batch, metrics["timing_s/step"]))
        return metrics

    # ----------------------------------------------------------------- stages
    def _plan_param_offload(self, skip_old: bool) -> set:
        """actor.offload_params: the passes before the actor's update its weights are away for,
        of "ref" (a reference model's own pass) and "critic" (values and the critic's update);
        and whether generation brings them back (not when no pass before the critic reads them).
        Generation and the reward model are decided by RolloutStage (offloads_in_gen)."""
        if not self.actor.offloads_params:
            return set()
        lora_ref = isinstance(self.ref, AdapterFreeReference)  # the actor's base: it reads them
        away = {"ref"} if self.ref is not None and not lora_ref else set()
        away |= {"critic"} if self.critic is not None else set()
        self.rollout.params_back_after_gen = not (skip_old and not lora_ref and away)
        return away

    def generate_and_score(self, timer) -> tuple[RolloutBatch, dict]:
        """New prompts -> gen -> reward; with dynamic sampling, rounds of that until the step holds
        data.prompts_per_step informative groups; then the overlong penalty (DAPO). With
        reward.launch_reward_fn_async or reward.score_in_pass the reward metrics are a
        PendingScores: scores_ready puts the scores on the batch later."""
        cfg, rounds = self.cfg, itertools.count()
        ds = cfg.algo.dynamic_sampling

        def one_round(prompts: Optional[int] = None):  # this rank's; None: one batch
            items = [self.dataset[i] for i in self.sampler.next_prompts(
                self.sampler.local_batch_size if prompts is None else prompts)]
            batch = self.rollout.generate(items, step=self.step, round_index=next(rounds), timer=timer)
            if cfg.reward.launch_reward_fn_async:  # scored behind the passes (scores_ready)
                return batch, self.rollout.score_async(items, batch)
            if cfg.reward.score_in_pass:  # scored inside the first forward-only pass
                return batch, self.rollout.score_deferred(items, batch)
            with timer("reward"):
                batch.scores, metrics = self.rollout.score(items, batch)
            return batch, metrics

        calls = itertools.count()  # rollout.partial's generate calls this step (their seeds)
        if cfg.rollout.partial.enable and not ds.enable:
            batch, metrics = self.partial_round(timer, calls)
        elif not ds.enable:
            batch, metrics = one_round()
        else:  # rounds of new prompts, or with rollout.partial of complete in-flight groups
            next_round = (functools.partial(self.partial_round, timer, calls)
                          if cfg.rollout.partial.enable else one_round)
            batch, metrics = fill_informative(
                next_round, num_groups=self.sampler.local_batch_size, group_size=cfg.rollout.n,
                max_rounds=ds.max_rounds, dp_group=self.ctx.dp_group, pad_id=self.tokenizer.pad_id,
                batches_per_round=ds.batches_per_round, adaptive=ds.adaptive,
                kept_estimate=self.kept_estimate, confidence=ds.round_confidence)
            self.kept_estimate = metrics["dynamic_sampling/kept_fraction"]
            if metrics["dynamic_sampling/cap_hit"]:
                self.logger.print(f"step {self.step + 1}: dynamic sampling found too few informative "
                                  f"groups in {ds.max_rounds} rounds; training with "
                                  f"{metrics['dynamic_sampling/filler_groups']:.0f} uninformative ones")
        if isinstance(metrics, PendingScores):
            return batch, metrics
        return batch, self.overlong(batch, metrics)

    def scores_ready(self, batch: RolloutBatch, pending, timer) -> dict:
        """reward.launch_reward_fn_async / score_in_pass: wait for the step's rule scores, or
        score them if no pass did (timing_s/reward: that time), and put them, with the overlong
        penalty, on `batch` (the step's rows in the order they were generated); returns the
        reward metrics."""
        with timer("reward"):
            batch.scores, metrics = pending.result()
        return self.overlong(batch, metrics)

    def overlong(self, batch: RolloutBatch, metrics: dict) -> dict:
        """DAPO's overlong penalty (reward.overlong_buffer) added to batch.scores."""
        ob = self.cfg.reward.overlong_buffer
        if ob.enable:
            penalty = overlong_penalty(batch.response_mask.sum(1),
                                       max_len=self.cfg.rollout.max_new_tokens,
                                       buffer_len=ob.len, penalty_factor=ob.penalty_factor)
            batch.scores = batch.scores + penalty
            metrics["reward/overlong_penalty/mean"] = (
                dp_sum(float(penalty.mean()), group=self.ctx.dp_group) / self.ctx.dp_size)
        return metrics

    def partial_round(self, timer, calls, prompts: Optional[int] = None
                      ) -> tuple[RolloutBatch, dict]:
        """rollout.partial: top the in-flight groups up with fresh prompts, one capped generation
        (and an uncapped one for missing or stale groups), score `prompts` (this rank's; None: a
        batch) worth of complete groups (a dynamic-sampling round may take several batches;
        hybridflow/rollout/partial.py). `calls`: the step's generate-call counter (each call its
        own seeds)."""
        cfg, pr = self.cfg, self.partial
        take = self.sampler.local_batch_size if prompts is None else prompts
        need = pr.fresh_needed(take)
        while len(self.partial_queue) < need:  # whole sampler batches; the rest wait their turn
            self.partial_queue += [self.dataset[i] for i in self.sampler.next_batch()]
        pr.add(self.partial_queue[:need], self.step)
        self.partial_queue = self.partial_queue[need:]

        def gen_rows(prompts: list, max_new: int) -> RolloutBatch:
            r = dataclasses.replace(cfg.rollout, n=1, max_new_tokens=max_new)
            return self.rollout.generate(row_items(prompts), step=self.step, timer=timer,
                                         rollout_cfg=r, round_index=next(calls))

        g = self.ctx.dp_group
        groups, pm = pr.step(gen_rows, self.step, take=take,
                             anywhere=lambda has: dp_sum(float(has), group=g) > 0)
        batch = pr.batch(groups, pad_id=self.tokenizer.pad_id,
                         first_group=self.ctx.train.dp * len(groups))
        items = [grp.item for grp in groups]
        with timer("reward"):
            batch.scores, metrics = self.rollout.score(items, batch)
        metrics.update({k: dp_sum(v, group=g) for k, v in pm.items() if k != "partial/staleness_max"})
        metrics["partial/decode_steps"] /= self.ctx.dp_size
        metrics["partial/staleness_max"] = dp_max(pm["partial/staleness_max"], group=g)
        return batch, metrics

    def compute_advantages(self, batch: RolloutBatch):
        a = self.cfg.algo
        # global batch, same order on every rank
        full = all_gather_batch(_without_experts(batch), group=self.ctx.dp_group,
                                pad_id=self.tokenizer.pad_id)
        # the model's own tokens (tool results of a multi-turn rollout excluded); the score sits
        # on each row's last one
        mask = full.loss_mask().float()
        token_scores = torch.zeros_like(mask)
        last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(1)
        token_scores[torch.arange(mask.shape[0]), last] = full.scores.float()
        metrics = {}
        if a.use_kl_in_reward:
            token_rewards, kl_m = apply_kl_penalty(
                token_scores=token_scores, logprobs=full.old_logprobs, ref_logprobs=full.ref_logprobs,
                response_mask=mask, kl_coef=self.kl_ctrl.value, kind=a.kl_penalty)
            self.kl_ctrl.update(float(kl_m["kl"]), n_steps=full.batch_size)
            metrics.update({"actor/reward_kl_penalty": float(kl_m["kl"]),
                            "actor/reward_kl_penalty_coeff": float(kl_m["kl_coef"])})
        else:
            token_rewards = token_scores
        adv, ret = self.estimator(token_rewards=token_rewards, response_mask=mask,
                                  values=full.values, group_ids=full.group_ids, gamma=a.gamma,
                                  lam=a.lam, norm_by_std=a.norm_adv_by_std)
        n = mask.sum()
        metrics.update({
            "critic/score/mean": float(full.scores.float().mean()),
            "critic/rewards/mean": float((token_rewards * mask).sum(1).mean()),
            "critic/advantages/mean": float((adv * mask).sum() / n),
            "critic/returns/mean": float((ret * mask).sum() / n)})
        if full.values is not None:
            metrics["critic/values/mean"] = float((full.values * mask).sum() / n)
        if full.old_logprobs is not None:  # generator vs training forward; else after the update
            metrics.update(batch_mismatch_metrics(full, cap=a.tis_imp_ratio_cap))
        lengths, prompts = full.response_mask.sum(1).float(), full.prompt_mask.sum(1).float()
        self.step_lengths = lengths.to(torch.int64).tolist()
        metrics.update({"prompt_length/mean": float(prompts.mean()),
                        "prompt_length/max": float(prompts.max()),
                        "response_length/mean": float(lengths.mean()),
                        "response_length/max": float(lengths.max()),
                        "response_length/min": float(lengths.min()),
                        "response_length/clip_ratio": float(
                            (lengths >= self.cfg.rollout.max_new_tokens).float().mean())})
        r = self.ctx.train.dp
        rows = slice(r * batch.batch_size, (r + 1) * batch.batch_size)
        width = batch.response_ids.shape[1]
        batch.token_rewards, batch.advantages, batch.returns = (
            t[rows, :width].contiguous() for t in (token_rewards, adv, ret))
        return batch, metrics

    def update(self, engine, batch: RolloutBatch, objective, *, on_policy: bool = False) -> dict:
        """ppo_epochs x mini-batches of optimizer steps; each metric averaged over the updates that
        report it (grad_norm over the updates taken; `<role>/update_skipped`: the skipped share).
        on_policy (no old_log_prob pass): pi_old is the one update's forward -> batch.old_logprobs"""
        a = self.cfg.algo
        local_mini = a.ppo_mini_batch_size // self.ctx.dp_size
        sums, counts = {}, {}
        if on_policy:
            assert a.ppo_epochs == 1 and local_mini == batch.batch_size, "on_policy needs one update"
            old_logprobs = torch.zeros(batch.response_ids.shape)  # (B, R)
        for epoch in range(a.ppo_epochs):
            gen = torch.Generator().manual_seed(self.cfg.trainer.seed * 7919 + self.step * 31 + epoch)
            order = torch.randperm(batch.batch_size, generator=gen)
            for i in range(0, batch.batch_size, local_mini):
                mb = batch.select(order[i:i + local_mini])
                num_tokens = int(dp_sum(float(mb.loss_mask().sum()), group=self.ctx.dp_group))
                scale = a.loss_scale_factor or self.cfg.rollout.max_new_tokens  # seq-mean-token-sum-norm
                loss_fn = objective(a, num_tokens=max(num_tokens, 1),
                                    num_seqs=a.ppo_mini_batch_size, loss_scale_factor=scale,
                                    **({"old_is_current": True} if on_policy else {}))
                m = engine.train_step(mb, loss_fn, temperature=self.temperature,
                                      need_entropy=engine.role == "actor", keep_logprobs=on_policy,
                                      **micro_batching(a, forward=False))
                if on_policy:
                    old_logprobs[order[i:i + local_mini]] = m.pop("logprobs")
                prefix = "actor" if engine.role == "actor" else "critic"
                skipped = m["update_skipped"] > 0
                self.skipped.record(step=self.step + 1, role=prefix, epoch=epoch,
                                    index=i // local_mini, batch=mb, skipped=skipped)
                m = {f"{prefix}/{k}" if k in ROLE_METRICS else k: v
                     for k, v in m.items() if not (skipped and k == "grad_norm")}
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                    counts[k] = counts.get(k, 0) + 1
        if on_policy:
            batch.old_logprobs = old_logprobs
        return {k: v / counts[k] for k, v in sums.items()}

    def sft_warmup(self) -> None:
        """Supervised steps on each record's `extra_info.sft_response` (synthetic tasks)."""
        steps = self.cfg.trainer.sft_warmup_steps
        lr = self.cfg.trainer.sft_lr or self.cfg.actor_optim.lr
        for s in range(steps):
            items = [self.dataset[i] for i in self.sampler.next_batch()]
            batch = self.rollout.sft_batch(items)
            num_tokens = int(dp_sum(float(batch.response_mask.sum()), group=self.ctx.dp_group))
            m = self.actor.train_step(batch, sft_objective(num_tokens=num_tokens), lr=lr,
                                      **micro_batching(self.cfg.algo, forward=False))
            if (s + 1) % 10 == 0 or s + 1 == steps:
                self.logger.print(f"sft warm-up {s + 1}/{steps}: nll={m['sft/nll']:.3f}")
        self.sft_done = True

    def throughput(self, batch: RolloutBatch, step_s: float) -> dict:
        # every model-parallel replica holds its DP share; count each token once
        tokens = dp_sum(float(batch.token_mask().sum()), group=self.ctx.dp_group)
        world = dist.get_world_size()
        return {"perf/total_num_tokens": tokens, "perf/throughput": tokens / (step_s * world)}

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The trainer's state for a checkpoint; a collective over DP with rollout.partial (every
        rank's groups in flight). RNG states are per rank: hybridflow.checkpoint saves and
        restores them itself."""
        return {"step": self.step, "sft_done": self.sft_done,
                "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "kept_estimate": self.kept_estimate, "train_data": self.train_data,
                "partial": None if self.partial is None else gather_state(
                    self.partial, self.partial_queue, self.ctx.dp_group)}

    def load_state_dict(self, state: dict, *, restart_epoch: bool = False) -> None:
        """restart_epoch: the training data changed (trainer.resume_allow_data_change)."""
        self.step = state["step"]
        self.sft_done = state["sft_done"]
        self.sampler.load_state_dict(state["sampler"], restart_epoch=restart_epoch)
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.kept_estimate = state.get("kept_estimate")  # absent in checkpoints before it
        self.partial_queue, line = restore_partial(
            self.partial, state.get("partial"), dataset=self.dataset, dp_size=self.ctx.dp_size,
            dp_rank=dist.get_rank(group=self.ctx.dp_group), restart_epoch=restart_epoch,
            legacy_count=state.get("partial_in_flight", 0))
        if line and dist.get_rank() == 0:
            print(line, flush=True)


def _without_experts(batch: RolloutBatch) -> RolloutBatch:
    """The batch without its recorded routing (actor.router_replay): not gathered where unused."""
    return dataclasses.replace(batch, prompt_experts=None, response_experts=None)


def offload_params_note(trainer) -> Optional[str]:
    """A warning when actor.offload_params can lower no phase's memory in this run: generation
    reads the training weights in place and every GPU pass before the actor's update reads them
    too (no critic, no reference model of its own, no reward model)."""
    t, cfg = trainer, trainer.cfg
    own_ref = t.ref is not None and not isinstance(t.ref, AdapterFreeReference)
    if (t.rollout.offloads_in_gen(cfg.rollout.quantization) or t.critic is not None or own_ref
            or t.rollout.reward_engine is not None):
        return None
    return ("hybridflow: warning: actor.offload_params=true saves no GPU memory in this run: "
            "generation decodes from the training weights in place (rollout.quantization=none, "
            "rollout.tensor_parallel_size = parallel.tensor_parallel_size, PP = 1) and every "
            "pass before the actor's update reads them (no critic, no reference model of its "
            "own, no reward model); it would only add PCIe copies, so turn it off "
            "(docs/recipes.md, Small cards)")


def gc_generation(step: int, interval: int, full_interval: int) -> Optional[int]:
    """The generation `gc.collect` takes at the start of `step` (None: no collection): every
    `interval` steps (0: never, automatic GC), the young ones (1: objects made since the last
    collection) unless the step is a multiple of `full_interval` (2: everything not frozen)."""
    if interval <= 0 or step % interval:
        return None
    return 2 if step % full_interval == 0 else 1


@contextlib.contextmanager
def manual_gc(enabled: bool):
    """Automatic Python GC off inside (the step collects explicitly); objects alive on entry (models,
    optimizer, dataset) are frozen out of later collections so each one scans only the step's garbage."""
    if not enabled or not gc.isenabled():
        yield
        return
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def pass_shape_metrics(stage: str, engine) -> dict:
    """perf/<stage>_micro_batches and perf/<stage>_smallest_micro_batch_tokens of the engine's
    latest pass (the stage's last, with several mini-batches): a step a few rows past a multiple
    of the token budget runs one micro-batch more, and sorted next-fit makes it small
    (algo.balance_micro_batches deals the rows evenly instead)."""
    shape = engine.last_pass
    if not shape:
        return {}
    return {f"perf/{stage}_{k}": float(v) for k, v in shape.items()}
