"""One engine class for every role: a Megatron GPTModel with forward-only and train-step passes.

Actor, reference, critic and reward model differ only in their head (LM vs scalar) and whether they
train (DDP + Megatron optimizer + LR schedule). Both passes go through Megatron's
`get_forward_backward_func()`, so TP, PP (1F1B) and DP work the same for every role.

Loss scaling: loss functions (hybridflow.algo) normalise by *global* denominators (tokens or sequences
of the whole mini-batch across micro-batches and DP ranks). Megatron divides each micro-batch loss by
the number of micro-batches and DDP averages grads over DP, so the engine multiplies by both: the
gradient is then exactly the full mini-batch loss's gradient, however the batch is split.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer.module import Float16Module

from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.models.build import LM_ROLES, build_model
from hybridflow.models.logprob import vocab_parallel_logprobs
from hybridflow.parallel.context import ParallelContext

LossFn = Callable[[dict, RolloutBatch], tuple[torch.Tensor, dict]]


def attention_mask(token_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """(B, S) 0/1 -> Megatron bool mask (B, 1, S, S), True = masked; None when nothing is padded.
    The mask is complete (causal AND key-valid): Megatron's own softmax adds the causal part only
    when no mask is given. Padded queries attend to themselves so no softmax row is empty."""
    if bool(token_mask.all()):
        return None
    s = token_mask.shape[1]
    eye = torch.eye(s, dtype=torch.bool, device=token_mask.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=token_mask.device).tril()
    allowed = (token_mask.bool()[:, None, None, :] & causal) | eye
    return ~allowed


class Engine:
    def __init__(self, *, role: str, model_cfg: ModelConfig, ctx: ParallelContext,
                 parallel: ParallelConfig, precision: str, optim: Optional[OptimConfig] = None,
                 total_updates: int = 1):
        self.role = role
        self.ctx = ctx
        self.model_cfg = model_cfg
        # ids >= vocab_limit are never sampled nor scored (vocab padding, ids the tokenizer lacks)
        self.vocab_limit = model_cfg.vocab_size
        self.trainable = optim is not None
        model = build_model(model_cfg, role=role, ctx=ctx,
                            sequence_parallel=parallel.sequence_parallel, precision=precision)
        self.module = model  # the bare GPTModel (for reshard, checkpoint import/export)
        self.tcfg = model.config
        if precision == "bf16":
            model = Float16Module(self.tcfg, model)
        self.optimizer = self.scheduler = None
        if self.trainable:
            dist_opt = parallel.use_distributed_optimizer and ctx.dp_size > 1
            ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                    overlap_grad_reduce=False,
                                                    use_distributed_optimizer=dist_opt)
            model = DDP(self.tcfg, ddp_cfg, model, pg_collection=ctx.pgs)
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr,
                                weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1,
                                adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                                clip_grad=optim.clip_grad, bf16=precision == "bf16",
                                params_dtype=self.tcfg.params_dtype,
                                use_distributed_optimizer=dist_opt),
                [model], use_gloo_process_groups=False, pg_collection=ctx.pgs)
            self.scheduler = OptimizerParamScheduler(
                self.optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
                max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
                lr_decay_steps=max(total_updates, optim.lr_warmup_steps + 1),
                lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay,
                end_wd=optim.weight_decay, wd_incr_steps=max(total_updates, 1),
                wd_incr_style="constant",
                # on resume the config's schedule wins (e.g. a longer run); the step count is restored
                use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
            self.tcfg.no_sync_func = model.no_sync
            self.tcfg.finalize_model_grads_func = functools.partial(finalize_model_grads,
                                                                    pg_collection=ctx.pgs)
            self.tcfg.grad_scale_func = self.optimizer.scale_loss
        else:
            for p in model.parameters():
                p.requires_grad_(False)
            model.eval()
        self.model = model
        self.device = ctx.device
        self._p2p = P2PCommunicator(pp_group=ctx.pp_group, config=self.tcfg)

    # ------------------------------------------------------------------ placement
    def offload(self) -> None:
        """Move a frozen model's weights to host memory (the reference between its passes)."""
        assert not self.trainable, "only frozen roles are offloaded"
        for p in self.model.parameters():
            p.data = p.data.to("cpu", non_blocking=True)

    def onload(self) -> None:
        for p in self.model.parameters():
            p.data = p.data.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ passes
    def _run(self, batch: RolloutBatch, *, micro_batch_size: int, forward_only: bool,
             loss_fn: Optional[LossFn], temperature: float, need_entropy: bool):
        if self.tcfg.sequence_parallel:  # the sequence is split over TP: its length must divide
            batch = batch.padded_to(self.ctx.tp_size)
        micro = [mb.to(self.device) for mb in batch.split(micro_batch_size)]
        p, seq_len = batch.prompt_len, batch.input_ids().shape[1]
        tp_group = self.ctx.tp_group
        dp = self.ctx.dp_size
        n_micro = len(micro)

        def forward_step(data_iter, model):
            mb = next(data_iter)
            out = model(mb.input_ids(), mb.position_ids(), attention_mask(mb.token_mask()))

            def loss_func(output):
                # outputs that predict response tokens; a reward model reads each token's own state
                pred = output[:, p:] if self.role == "reward" else output[:, p - 1:-1]
                if self.role in LM_ROLES:
                    res = _lm_head(pred, mb, tp_group=tp_group, temperature=temperature,
                                   true_vocab=self.vocab_limit, entropy=need_entropy)
                else:
                    res = {"values": pred.squeeze(-1).float()}
                if loss_fn is None:
                    zero = output.sum() * 0.0
                    return zero, {k: v.detach() for k, v in res.items()}
                loss, metrics = loss_fn(res, mb)
                return loss * (n_micro * dp), {k: v.detach() for k, v in metrics.items()}

            return out, loss_func

        if self.trainable and not forward_only:
            self.model.train()
        else:
            self.model.eval()
        with torch.set_grad_enabled(not forward_only):
            return get_forward_backward_func(pp_size=self.ctx.pp_size)(
                forward_step_func=forward_step, data_iterator=iter(micro), model=[self.model],
                num_microbatches=n_micro, seq_length=seq_len, micro_batch_size=micro_batch_size,
                forward_only=forward_only, p2p_communicator=self._p2p,
                pg_collection=self.ctx.pgs)

    def compute_logprobs(self, batch: RolloutBatch, *, micro_batch_size: int,
                         temperature: float = 1.0) -> torch.Tensor:
        out = self._run(batch, micro_batch_size=micro_batch_size, forward_only=True,
                        loss_fn=None, temperature=temperature, need_entropy=False)
        return self._from_last_stage(out, "logprobs", batch)

    def compute_values(self, batch: RolloutBatch, *, micro_batch_size: int) -> torch.Tensor:
        out = self._run(batch, micro_batch_size=micro_batch_size, forward_only=True,
                        loss_fn=None, temperature=1.0, need_entropy=False)
        return self._from_last_stage(out, "values", batch)

    def compute_scores(self, batch: RolloutBatch, *, micro_batch_size: int) -> torch.Tensor:
        """Reward model: the scalar head at each row's last response token. (B,)"""
        values = self.compute_values(batch, micro_batch_size=micro_batch_size)
        last = (batch.response_mask.sum(1) - 1).clamp(min=0)
        return values[torch.arange(batch.batch_size), last]

    def train_step(self, batch: RolloutBatch, loss_fn: LossFn, *, micro_batch_size: int,
                   temperature: float = 1.0, need_entropy: bool = False,
                   lr: Optional[float] = None) -> dict:
        """One optimizer step on `batch` (this rank's share of a mini-batch). With `lr`, the step
        uses that fixed rate and leaves the LR schedule where it is (supervised warm-up)."""
        assert self.trainable
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(batch, micro_batch_size=micro_batch_size, forward_only=False,
                        loss_fn=loss_fn, temperature=temperature, need_entropy=need_entropy)
        scheduled = [g["lr"] for g in self.optimizer.param_groups]
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        used_lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if lr is not None:
            for g, value in zip(self.optimizer.param_groups, scheduled):
                g["lr"] = value
        elif ok:
            self.scheduler.step(increment=1)
        metrics = _sum_metrics(out, self.ctx)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = used_lr
        return metrics

    def _from_last_stage(self, outs: list, key: str, batch: RolloutBatch) -> torch.Tensor:
        """Concatenate per-micro-batch results and broadcast them from the last PP stage."""
        width = batch.response_ids.shape[1]
        ctx = self.ctx
        if self.tcfg.sequence_parallel:
            width = batch.padded_to(ctx.tp_size).response_ids.shape[1]
        shape = (batch.batch_size, width)
        if ctx.is_pp_last_stage:
            t = torch.cat([o[key] for o in outs], dim=0).float().contiguous()
        else:
            t = torch.empty(shape, dtype=torch.float32, device=self.device)
        if ctx.pp_size > 1:
            dist.broadcast(t, src=ctx.pp_last_rank, group=ctx.pp_group)
        return t[:, :batch.response_ids.shape[1]].cpu()


def _lm_head(pred, mb, *, tp_group, temperature, true_vocab, entropy):
    res = vocab_parallel_logprobs(pred, mb.response_ids, tp_group=tp_group,
                                  true_vocab_size=true_vocab, temperature=temperature,
                                  with_entropy=entropy)
    if entropy:
        return {"logprobs": res[0], "entropy": res[1]}
    return {"logprobs": res}


def _sum_metrics(outs: list, ctx: ParallelContext) -> dict:
    """Per-micro-batch metric contributions summed over micro-batches and DP ranks (last stage),
    then shared with the other PP stages."""
    dev = ctx.device
    keys = sorted(outs[0].keys()) if outs else []
    vec = torch.tensor([sum(float(o[k]) for o in outs) for k in keys], dtype=torch.float64,
                       device=dev)
    n = torch.tensor([len(keys)], dtype=torch.int64, device=dev)
    if ctx.pp_size > 1:
        src, group = ctx.pp_last_rank, ctx.pp_group
        dist.broadcast(n, src=src, group=group)
        obj = [keys]
        dist.broadcast_object_list(obj, src=src, group=group)
        keys = obj[0]
        if vec.numel() != int(n):
            vec = torch.zeros(int(n), dtype=torch.float64, device=dev)
        dist.broadcast(vec, src=src, group=group)
    if ctx.dp_size > 1:
        dist.all_reduce(vec, group=ctx.dp_group)
    return dict(zip(keys, vec.tolist()))
