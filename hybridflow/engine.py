"""One engine class for every role: a Megatron GPTModel with forward-only and train-step passes.

Actor, reference, critic and reward model differ only in their head (LM vs scalar) and whether they
train (DDP + Megatron optimizer + LR schedule). Both passes go through Megatron's
`get_forward_backward_func()`, so TP, PP (1F1B) and DP work the same for every role.

Micro-batches: `micro_batch_size` rows each, all padded to the batch's widths (the default); or,
with `max_tokens` (algo.use_dynamic_bsz), by token budget: rows grouped by length
(hybridflow.data.microbatch), each micro-batch trimmed to its own longest prompt and response, and
the per-row results scattered back to the batch's row order. Padding columns carry no loss weight, so
both give the same results; the budget only changes how much padding is computed.

Sequence packing (`pack`, algo.pack_sequences; on with token budgets on a GPU by default): each
token-budget micro-batch that holds padding runs as ONE row of its rows' real tokens back to back (no
padding computed but the tail to a multiple of TP under sequence parallel), attention limited to
each row's own tokens, causally (hybridflow.data.packing; hybridflow.models.attention: torch's
varlen FlashAttention over the rows' cu_seqlens on CUDA, a flex_attention block mask elsewhere,
algo.packed_attention). The budget then counts real tokens. The loss still
sees the padded micro-batch: per-token results over the packed row are gathered into its (b, R_mb)
layout (`PackedRows.unpack`, differentiable). No explicit SDPA mask is passed, so the cuDNN
masked-backward bug routed around in models/attention.py does not arise. With the per-layer CUDA
graphs of the update (parallel.train_cuda_graphs, models/graphs.py) the packed rows of a training
pass are padded to one static shape (`_fit_to_shape`: the token budget, a fixed count of documents,
a fixed longest one) whose cu_seqlens go into the capture's buffer: those micro-batches replay.

Loss scaling: loss functions (hybridflow.algo) normalise by *global* denominators (tokens or sequences
of the whole mini-batch across micro-batches and DP ranks). Megatron divides each micro-batch loss by
the number of micro-batches and DDP averages grads over DP, so the engine multiplies by both: the
gradient is then exactly the full mini-batch loss's gradient, however the batch is split. The count
is this rank's own: with token budgets, micro-batches differ in rows and DP ranks may run different
numbers of them, and the product stays exact (Megatron's no-pipeline schedule reduces grads once per
step). Pipeline schedules need equal micro-batch shapes on every stage: token budgets are refused
with PP > 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer.module import Float16Module

from hybridflow.checkpoint.optim import use_fused_adam
from hybridflow.config import LoRAConfig, ModelConfig, OptimConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch
from hybridflow.data.microbatch import token_budget_groups
from hybridflow.data.packing import (PackedRows, PackedShape, fit_packed, fits, pack_rows,
                                     packed_length, row_lengths, shape_for_rows)
from hybridflow.data.transfer import to_device
from hybridflow.models.attention import (SDPAttention, choose_packed_attention, packed_documents,
                                         varlen_unsupported)
from hybridflow.models.build import LM_ROLES, build_model
from hybridflow.models.graphs import graph_layers, ungraph_layers
from hybridflow.models.heads import ValueHead
from hybridflow.models.linear import (LeanColumnParallelLinear, LeanOutputLinear,
                                      LeanRowParallelLinear, LogprobSpec)
from hybridflow.models.logprob import vocab_parallel_logprobs
from hybridflow.models.lora import adapters_disabled, apply_lora, factors_fixed
from hybridflow.models.quack_mlp import resolve_mlp_kernels
from hybridflow.offload import GradBufferRelease, OptimizerOffload, ParamOffload, host_copy
from hybridflow.parallel import multi_tensor
from hybridflow.parallel.context import ParallelContext

LossFn = Callable[[dict, RolloutBatch], tuple[torch.Tensor, dict]]


def attention_mask(token_mask: torch.Tensor, *, padded: Optional[bool] = None
                   ) -> Optional[torch.Tensor]:
    """(B, S) 0/1 -> Megatron bool mask (B, 1, S, S), True = masked; None when nothing is padded.
    The mask is complete (causal AND key-valid): Megatron's own softmax adds the causal part only
    when no mask is given. Padded queries attend to themselves so no softmax row is empty.
    `padded`: whether any token is padding, when the caller knows it (else read from the mask: on
    a GPU that read is a stream sync)."""
    if padded is None:
        padded = not bool(token_mask.all())
    if not padded:
        return None
    s = token_mask.shape[1]
    eye = torch.eye(s, dtype=torch.bool, device=token_mask.device)
    causal = torch.ones(s, s, dtype=torch.bool, device=token_mask.device).tril()
    allowed = (token_mask.bool()[:, None, None, :] & causal) | eye
    return ~allowed


class Engine:
    def __init__(self, *, role: str, model_cfg: ModelConfig, ctx: ParallelContext,
                 parallel: ParallelConfig, precision: str, optim: Optional[OptimConfig] = None,
                 total_updates: int = 1, lora: Optional[LoRAConfig] = None, seed: int = 0,
                 offload_optimizer: bool = False, offload_grads: bool = False,
                 router_replay: str = "disabled", offload_params: bool = False,
                 packed_attention: str = "auto", balanced_micro_batches: bool = False):
        """`lora` (actor.lora / critic.lora, rank > 0; trainable roles): LoRA adapters on the
        decoder linears, the only parameters that train with a scalar role's value head
        (models/lora.py); `seed` draws their A factors.
        `offload_optimizer` (actor.offload_optimizer): master weights and Adam state in host
        memory but for the optimizer step (hybridflow/offload.py). `offload_grads`
        (actor.offload_grads): the gradient buffers exist only from the start of an update to the
        end of its optimizer step (their storage released in between; hybridflow/offload.py).
        `router_replay` (actor.router_replay, MoE models): "R3" routes the tokens of batches that
        carry recorded experts to them (models/moe.py); "disabled": the routers' own
        choice.
        `offload_params` (actor.offload_params): the weights (LoRA: the frozen base) can leave the
        device between passes (`params_to_host` / `params_to_device`; every pass brings them back
        first; hybridflow/offload.py).
        `balanced_micro_batches` (algo.balance_micro_batches): packed token-budget micro-batches
        dealt evenly into the fewest that hold the rows (data/microbatch.py); not the graphed
        update's, whose micro-batches are padded to the budget (more, fuller ones compute more).
        `packed_attention` (algo.packed_attention): the kernel of packed micro-batches, chosen at
        the first one (models/attention.py `choose_packed_attention`; rank 0 prints the choice
        once per run)."""
        self.role = role
        self.ctx = ctx
        self.model_cfg = model_cfg
        # ids >= vocab_limit are never sampled nor scored (vocab padding, ids the tokenizer lacks)
        self.vocab_limit = model_cfg.vocab_size
        self.trainable = optim is not None
        model = build_model(model_cfg, role=role, ctx=ctx,
                            sequence_parallel=parallel.sequence_parallel, precision=precision,
                            activation_checkpointing=parallel.activation_checkpointing,
                            fused_elementwise=parallel.fused_elementwise,
                            swiglu_backward=parallel.swiglu_backward,
                            rope_from_qkv=parallel.rope_from_qkv,
                            quack_mlp=resolve_mlp_kernels(parallel.mlp_kernels, ctx.device))
        self.num_adapter_params = 0
        self.lora = lora if lora is not None and lora.rank > 0 else None
        if self.lora is not None:
            if optim is None:
                raise ValueError(f"role {role}: LoRA adapters need a trainable role")
            self.num_adapter_params = apply_lora(
                model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                target_modules=lora.target_modules, seed=seed,
                salt="" if role == "actor" else f"{role}/", key=f"{role}.lora")
            head = getattr(model, "output_layer", None)
            if isinstance(head, ValueHead):  # a new head (the critic's): it trains in full
                for p in head.parameters():
                    p.requires_grad_(True)
        self._lm_chunk = parallel.lm_head_chunk_tokens
        # parallel.train_cuda_graphs (CUDA only; _capture_graphs): the (seq_len, rows) the layers
        # were captured at, or the PackedShape of a packed capture; None until the first training
        # pass. `_fit_packed`: the update's packed rows padded to one PackedShape (`_fit_to_shape`
        # chooses it, `_graph_docs` is the capture's documents)
        self._want_graphs = (parallel.train_cuda_graphs and optim is not None
                             and ctx.device.type == "cuda")
        self._fit_packed = self._want_graphs
        self._graph_min_fill = parallel.train_graphs_min_fill
        self._graph_shape: Optional[tuple[int, int] | PackedShape] = None
        self._next_packed_shape: Optional[PackedShape] = None
        self._graph_docs = None
        self.graphed = 0  # micro-batches of the last training pass that replayed the graphs
        self.module = model  # the bare GPTModel (for reshard, checkpoint import/export)
        self.tcfg = model.config
        # bf16: Megatron's wrapper would upcast the last stage's output to fp32, a full fp32 copy of
        # the (tokens x vocab) logits per micro-batch (25 GB at 40,960 tokens x 152k) that the
        # log-prob pass then reads and, in training, keeps for backward; the log-prob kernels read
        # bf16 logits and compute in fp32 themselves (models/logprob.py), and the value head
        # returns fp32 anyway: keep the output in bf16
        self._out_kw = {}
        if precision == "bf16":
            model = Float16Module(self.tcfg, model)
            self._out_kw = {"fp32_output": False}
        self.optimizer = self.scheduler = None
        self._opt_offload = None
        self._grad_release = None
        if self.trainable:
            dist_opt = parallel.use_distributed_optimizer and ctx.dp_size > 1
            ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                    overlap_grad_reduce=False,
                                                    use_distributed_optimizer=dist_opt)
            model = DDP(self.tcfg, ddp_cfg, model, pg_collection=ctx.pgs)
            if parallel.gradient_accumulation_fusion:  # needs the main_grad DDP just made
                for linear in self.module.modules():
                    if type(linear) in (LeanColumnParallelLinear, LeanRowParallelLinear):
                        linear.fuse_wgrad = True
            multi_tensor.install()  # the grad norm and param copies without a sync per tensor
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
            if offload_optimizer:
                self._opt_offload = OptimizerOffload(self.optimizer,
                                                     model_params=model.parameters(),
                                                     device=ctx.device)
                self._opt_offload.to_host()
            if offload_grads:
                self._grad_release = GradBufferRelease(model.buffers
                                                       + model.expert_parallel_buffers)
                self._grad_release.release()
        else:
            for p in model.parameters():
                p.requires_grad_(False)
            model.eval()
        self._param_offload = None
        if offload_params:
            if not self.trainable:
                raise ValueError(f"role {role}: offload_params is for trainable roles (frozen "
                                 "ones use offload()/onload())")
            moved = [p for p in model.parameters() if not (self.lora and p.requires_grad)]
            self._param_offload = ParamOffload(moved, device=ctx.device,
                                               frozen=self.lora is not None)
        self.model = model
        self._router_stats = None  # model.moe, trainable: expert loads of the training passes
        if self.trainable and model_cfg.moe.enabled:
            from hybridflow.models.moe import RouterStats

            self._router_stats = RouterStats(self.module, num_layers=model_cfg.num_layers,
                                             num_experts=model_cfg.moe.num_experts,
                                             top_k=model_cfg.moe.top_k, device=ctx.device)
        self._replay = None  # actor.router_replay: the routers' replay hooks
        if router_replay != "disabled" and model_cfg.moe.enabled:
            from hybridflow.models.moe import Replay

            self._replay = Replay(self.module)
        self.sdpa = any(isinstance(m, SDPAttention) for m in self.module.modules())
        self._packed_option = packed_attention
        self._balanced = balanced_micro_batches
        self.last_pass: Optional[dict] = None  # the latest pass's micro-batches (_pass_shape)
        self._packed_kernel: Optional[str] = None  # chosen at the first packed micro-batch
        # LM roles on the last stage compute logits only where they are scored (the positions that
        # predict response tokens: LeanOutputLinear.select), not over the prompt; the results are
        # the same (tests/dist/test_response_logits.py). None (scalar heads, cheap anyway; set it
        # to None to compare): every position.
        head = getattr(self.module, "output_layer", None) if self.module.post_process else None
        self._response_head = head if role in LM_ROLES and isinstance(head, LeanOutputLinear) \
            else None
        self.device = ctx.device
        self._host: Optional[list] = None  # offload(): the weights' host copy (pinned on CUDA)
        self._onload_done = None           # onload(prefetch=True): the copy's CUDA event
        self._copy_stream = None
        self._p2p = P2PCommunicator(pp_group=ctx.pp_group, config=self.tcfg)

    # ------------------------------------------------------------------ placement
    def offload(self) -> None:
        """A frozen model's weights to host memory (trainer.offload_ref: the reference between its
        passes). The host copy is made once (pinned on CUDA, for asynchronous copies back); later
        offloads only drop the device copy: frozen weights never change on the device, so nothing
        is copied back. While offloaded the parameters are the host tensors (a checkpoint load
        writes there)."""
        assert not self.trainable, "only frozen roles are offloaded"
        params = list(self.model.parameters())
        if self._host is None:
            self._host = [host_copy(p.data) for p in params]
        self.wait_onload()  # a prefetch still copying into the device tensors dropped here
        for p, h in zip(params, self._host):
            p.data = h

    def onload(self, *, prefetch: bool = False) -> None:
        """The weights back on the device: one host-to-device copy per tensor from the pinned host
        copy. `prefetch`: the copies run on a side stream and this returns at once; the next
        `onload()` (or `wait_onload()`) makes the current stream wait for them. Allocated on the
        current stream, so the memory is held from the call on."""
        params = list(self.model.parameters())
        if not params or params[0].device == self.device:  # already there (or prefetched)
            if not prefetch:
                self.wait_onload()
            return
        # off the device only after offload(): host tensors, on a CUDA device (a checkpoint load
        # may have put unpinned ones there)
        host = [p.data if p.data.is_pinned() else host_copy(p.data) for p in params]
        self._host = host
        dev = [torch.empty_like(h, device=self.device) for h in host]
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for d, h in zip(dev, host):
                d.copy_(h, non_blocking=True)
                d.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        self._onload_done = done
        for p, d in zip(params, dev):
            p.data = d
        if not prefetch:
            self.wait_onload()

    def wait_onload(self) -> None:
        """The current stream waits for a prefetching `onload` (no-op without one)."""
        if self._onload_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._onload_done)
            self._onload_done = None

    @property
    def offloads_params(self) -> bool:
        return self._param_offload is not None

    def params_to_host(self, keep: frozenset = frozenset()) -> None:
        """actor.offload_params: the weights (LoRA: the frozen base) to host memory, but for the
        storages whose data_ptr is in `keep`; no-op without the option."""
        if self._param_offload is not None:
            self._param_offload.to_host(keep)

    def params_offloaded_most_bytes(self) -> int:
        """actor.offload_params: the most bytes of the weights off the device at once since the
        last call (0 without the option)."""
        return 0 if self._param_offload is None else self._param_offload.most_away_bytes()

    def host_view(self, p: torch.Tensor) -> torch.Tensor:
        """Parameter `p`, or its bytes in the host copy while offloaded (actor.offload_params)."""
        return p if self._param_offload is None else self._param_offload.host_view(p)

    def params_to_device(self, *, prefetch: bool = False) -> None:
        """The offloaded weights back (`prefetch`: on a side stream; the next pass waits)."""
        if self._param_offload is not None:
            self._param_offload.to_device(prefetch=prefetch)

    # ------------------------------------------------------------------ passes
    def _micro_batches(self, batch: RolloutBatch, *, micro_batch_size: int,
                       max_tokens: Optional[int], pack: bool = False, fit: bool = False,
                       lazy: bool = False) -> tuple[list, Optional[torch.Tensor]]:
        """The micro-batches on the device, each with whether it holds padding (read on the host,
        before the copy, so the schedule never waits on the GPU for it) and (`pack`) its packed
        row, and (token budgets only) `rows` (B,): result row k belongs to batch row rows[k].
        `fit`: the packed rows padded to one PackedShape where they fit (`_fit_to_shape`).
        `lazy`: each still on the host (`_Staged`), packed and copied when the schedule asks for
        it, so that this host work runs behind the previous micro-batch's kernels."""
        # under sequence parallel the sequence is split over TP: its length must divide
        multiple = self.ctx.tp_size if self.tcfg.sequence_parallel else 1
        rows = None
        if max_tokens is None:
            micro = batch.padded_to(multiple).split(micro_batch_size)
        else:
            if self.ctx.pp_size > 1:
                raise ValueError("algo.use_dynamic_bsz=true needs parallel.pipeline_parallel_size=1: "
                                 "pipeline stages exchange micro-batches of one fixed shape")
            groups = token_budget_groups(batch.prompt_mask.sum(1), batch.response_mask.sum(1),
                                         max_tokens=max_tokens, multiple=multiple, packed=pack,
                                         balanced=self._balanced and not fit)
            micro = [batch.select(torch.tensor(g)).trimmed() for g in groups]
            rows = torch.tensor([i for g in groups for i in g])
        if pack:
            if max_tokens is None:
                raise ValueError("algo.pack_sequences=true needs algo.use_dynamic_bsz=true")
            if not self.sdpa:
                raise ValueError("algo.pack_sequences=true needs SDPAttention: set "
                                 "model.attention_backend=sdpa (auto picked transformer-engine)")
            self.packed_kernel()
            own = self.role == "reward"
            # a micro-batch of equal rows has no padding to leave out: it runs unpacked
            staged = []
            for mb in micro:
                whole = mb.padded_to(multiple)
                if bool(whole.token_mask().all()):
                    staged.append(_Staged(whole, False))
                else:
                    staged.append(_Staged(mb, False, functools.partial(
                        pack_rows, mb, multiple=multiple, own_position=own)))
            if fit:
                staged = self._fit_to_shape(staged, max_tokens=max_tokens, multiple=multiple)
        else:
            micro = [mb.padded_to(multiple) for mb in micro] if max_tokens is not None else micro
            staged = [_Staged(mb, not bool(mb.token_mask().all())) for mb in micro]
        if lazy:
            return staged, rows
        host = [(s.mb, None if s.pack is None else s.pack()) for s in staged]
        moved = to_device([x for pair in host for x in pair], self.device)
        return [(mb, s.padded, p) for mb, p, s in zip(moved[::2], moved[1::2], staged)], rows

    def _fit_to_shape(self, staged: list, *, max_tokens: int, multiple: int) -> list:
        """The packed micro-batches of `staged` (`_Staged`) planned at the packed CUDA graphs'
        shape, from their rows' lengths before any is packed (those that fit are packed and padded
        to it when they run; the rest stay as they are and run the eager layers). The shape:
        `length` the token budget (a multiple of `multiple`), the documents and longest row from
        this pass (`shape_for_rows`, with headroom); kept while at most a quarter of a pass's
        packed rows miss it, else grown to them (`_next_packed_shape`: the capture follows).
        Packed rows of fewer than parallel.train_graphs_min_fill of the budget's tokens (a pass's
        last micro-batch, usually) stay eager: padded, they would compute the rest of the budget."""
        length = -(-max_tokens // multiple) * multiple
        if self._want_graphs and not self._graphs_run_varlen():
            return staged  # flex builds a block mask per micro-batch: nothing static to capture
        rows = {i: row_lengths(s.mb) for i, s in enumerate(staged) if s.pack is not None}
        rows = {i: r for i, r in rows.items()
                if self._graph_min_fill * length <= packed_length(r, multiple) <= length}
        if not rows:
            return staged
        shape = self._graph_shape if isinstance(self._graph_shape, PackedShape) else None
        if shape is None or 4 * sum(not fits(r, shape) for r in rows.values()) > len(rows):
            shape = shape_for_rows(list(rows.values()), length=length, at_least=shape)
        self._next_packed_shape = shape
        return [s._replace(pack=functools.partial(_pack_fitted, s.pack, shape), fitted=True)
                if i in rows and fits(rows[i], shape) else s for i, s in enumerate(staged)]

    def _graphs_run_varlen(self) -> bool:
        """Whether the packed CUDA graphs can be captured: they run varlen (a static cu_seqlens
        buffer), which this run's kernel is, or runs beside (fa4: the fitted micro-batches replay
        on varlen, the others run fa4 eagerly)."""
        kernel = self.packed_kernel()
        if kernel != "fa4":
            return kernel == "varlen"
        return varlen_unsupported(self.device, self._compute_dtype(), self.tcfg.kv_channels) is None

    def _compute_dtype(self) -> torch.dtype:
        c = self.tcfg
        return torch.bfloat16 if c.bf16 else torch.float16 if c.fp16 else torch.float32

    def packed_kernel(self) -> str:
        """The packed micro-batches' attention kernel ("varlen" | "flex" | "fa4"), chosen once for
        this engine's device, compute dtype and head_dim from algo.packed_attention."""
        if self._packed_kernel is None:
            self._packed_kernel, line = choose_packed_attention(
                self._packed_option, device=self.device, dtype=self._compute_dtype(),
                head_dim=self.tcfg.kv_channels)
            if self.ctx.rank == 0:
                _print_once(f"hybridflow: {line}")
        return self._packed_kernel

    def _run(self, batch: RolloutBatch, *, micro_batch_size: int, forward_only: bool,
             loss_fn: Optional[LossFn], temperature: float, need_entropy: bool,
             max_tokens: Optional[int] = None, keep_logprobs: bool = False, pack: bool = False,
             replay: bool = True):
        replaying = replay and self._replay is not None
        if not replaying and batch.prompt_experts is not None:  # not carried to the device
            batch = dataclasses.replace(batch, prompt_experts=None, response_experts=None)
        self.params_to_device()  # offload_params: every pass reads the weights
        with record_function("engine.micro_batches"):  # profiler ranges: benchmarks' idle split
            micro, rows = self._micro_batches(
                batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, pack=pack,
                fit=self._fit_packed and self.trainable and not forward_only, lazy=True)
        # shapes for the pipeline schedules (PP > 1 runs only fixed micro-batches, all alike)
        seq_len = max(m[0].prompt_len + m[0].response_ids.shape[1] for m in micro)
        tp_group = self.ctx.tp_group
        dp = self.ctx.dp_size
        n_micro = self._n_micro = len(micro)
        self.last_pass = _pass_shape(micro)

        def forward_step(data_iter, model):
            with record_function("engine.forward"):
                return _forward_step(data_iter, model)

        def _forward_step(data_iter, model):
            mb, padded, packed = _on_device(next(data_iter), self.device)
            experts = self._router_targets(mb, packed) if replaying else None
            # the LM head only at the positions that predict response tokens (see __init__)
            select = self._response_head is not None and (packed is None or packed.scored.numel())
            if select:
                p = mb.prompt_len
                self._response_head.select = ((lambda x: x[p - 1:-1]) if packed is None else
                                              (lambda x: x[packed.scored]))
                if self._lm_chunk:  # the head returns log-probs (and entropy), not logits
                    targets = (mb.response_ids if packed is None else
                               packed.targets[:, packed.scored])
                    self._response_head.logprobs = LogprobSpec(
                        targets=targets.t(), true_vocab_size=self.vocab_limit,
                        temperature=temperature, with_entropy=need_entropy,
                        chunk_tokens=self._lm_chunk)
            try:
                with self._replay.bound(experts) if replaying else contextlib.nullcontext():
                    if packed is None:
                        out = model(mb.input_ids(), mb.position_ids(),
                                    attention_mask(mb.token_mask(), padded=padded), **self._out_kw)
                    else:  # one row (1, S); its results are gathered back into mb's (b, R_mb)
                        docs = self._graph_docs if packed.fitted else None
                        if docs is not None:  # the graphs' documents (the stream orders the copy
                            docs.cu_seqlens.copy_(packed.cu_seqlens)  # after the last backward)
                        else:
                            docs = packed_documents(packed.document_ids, packed.cu_seqlens,
                                                    packed.max_seqlen, kernel=self._packed_kernel)
                        out = model(packed.input_ids, packed.position_ids, docs, **self._out_kw)
            finally:
                if select:
                    self._response_head.select = self._response_head.logprobs = None

            def loss_func(output):
                with record_function("engine.loss"):
                    return _loss_func(output)

            def _loss_func(output):
                # outputs that predict response tokens; a reward model reads each token's own state
                if packed is None:
                    p = mb.prompt_len
                    pred = output if select else (
                        output[:, p:] if self.role == "reward" else output[:, p - 1:-1])
                    targets = mb.response_ids
                elif select:  # (1, n): the scored positions only
                    pred, targets = output, packed.targets[:, packed.scored]
                else:  # every packed position; a row's last one predicts garbage, never gathered
                    pred, targets = output, packed.targets
                if select and self._lm_chunk:  # (b, R, 1 or 2): the head's log-probs
                    res = {"logprobs": output[..., 0]}
                    if need_entropy:
                        res["entropy"] = output[..., 1]
                elif self.role in LM_ROLES:
                    res = _lm_head(pred, targets, tp_group=tp_group, temperature=temperature,
                                   true_vocab=self.vocab_limit, entropy=need_entropy)
                else:
                    res = {"values": pred.squeeze(-1).float()}
                if packed is not None:
                    unpack = packed.unpack_scored if select else packed.unpack
                    res = {k: unpack(v) for k, v in res.items()}
                if loss_fn is None:  # forward only: the schedule's loss is a placeholder (not
                    # output.sum() * 0: that reads the micro-batch's logits once more)
                    zero = torch.zeros((), dtype=torch.float32, device=output.device)
                    return zero, {k: v.detach() for k, v in res.items()}
                loss, metrics = loss_fn(res, mb)
                if not loss.requires_grad:  # Megatron would skip its backward without a word
                    raise RuntimeError(f"role {self.role}: the training loss does not depend on "
                                       "any trained parameter (no autograd graph reached it)")
                kept = {"logprobs": res["logprobs"]} if keep_logprobs else {}
                return loss * (n_micro * dp), {k: v.detach() for k, v in {**metrics, **kept}.items()}

            return out, loss_func

        if self.trainable and not forward_only:
            self.model.train()
            self.graphed = self._capture_graphs(micro) if self._want_graphs else 0
        else:
            self.model.eval()
        # LoRA: the adapters' factors stay as they are for the pass (models/lora.py)
        fixed = factors_fixed(self.module) if self.lora is not None else contextlib.nullcontext()
        with torch.set_grad_enabled(not forward_only), fixed, record_function("engine.schedule"):
            outs = get_forward_backward_func(pp_size=self.ctx.pp_size)(
                forward_step_func=forward_step, data_iterator=iter(micro), model=[self.model],
                num_microbatches=n_micro, seq_length=seq_len,
                micro_batch_size=max(m[0].batch_size for m in micro),
                forward_only=forward_only, p2p_communicator=self._p2p,
                pg_collection=self.ctx.pgs)
        return outs, rows

    def _router_targets(self, mb: RolloutBatch, packed: Optional[PackedRows]):
        """The recorded experts of a micro-batch in its routers' token order, (tokens, L, k) on the
        device (None: nothing recorded)."""
        from hybridflow.models.moe import router_order

        experts = mb.experts() if packed is None else (
            None if packed.experts is None else packed.experts[None])
        if experts is None:
            return None
        sp = self.ctx.tp_size if self.tcfg.sequence_parallel else 1
        return router_order(experts, sp_rank=self.ctx.train.tp, sp_size=sp)

    def replay_metrics(self, name: str) -> dict:
        """actor.router_replay: {name: the share of recorded (token, MoE layer) routing decisions
        that replay changed in the passes since the last call} (every rank calls it; empty when
        replay is off or nothing was recorded)."""
        return self._replay.metrics(name) if self._replay is not None else {}

    def _capture_graphs(self, micro: list) -> int:
        """parallel.train_cuda_graphs: capture the layers at the shape of this pass's most common
        unmasked, unpacked micro-batch (once: later passes reuse it), or, for packed micro-batches,
        at the PackedShape they were fitted to (again when it grew); returns how many of `micro`
        replay them."""
        shape = self._next_packed_shape
        if shape is not None:
            if shape != self._graph_shape:
                self._capture_packed(shape)
            return sum(1 for m in micro if m.fitted)
        shapes = [(m.mb.prompt_len + m.mb.response_ids.shape[1], m.mb.batch_size)
                  for m in micro if m.pack is None and not m.padded]
        if self._graph_shape is None and shapes:
            seq_len, rows = Counter(shapes).most_common(1)[0][0]
            self._graphed_capture(micro_batch_size=rows, seq_len=seq_len)
            self._graph_shape = (seq_len, rows)
        return shapes.count(self._graph_shape)

    def _capture_packed(self, shape: PackedShape) -> None:
        """The layers captured for packed rows of `shape` (the last capture's graphs dropped),
        with a static cu_seqlens buffer holding a valid layout until the first copy."""
        if self._graph_shape is not None:
            ungraph_layers(self.module)
            self._graph_docs = None
            torch.cuda.empty_cache()
        self._graph_docs = packed_documents(None, shape.placeholder_cu_seqlens().to(self.device),
                                            shape.max_seqlen, kernel="varlen")
        self._graphed_capture(micro_batch_size=1, seq_len=shape.length, docs=self._graph_docs)
        self._graph_shape = shape

    def _graphed_capture(self, **capture) -> None:
        """graph_layers(self.module, **capture) with DDP's gradient hooks made anew around it."""
        # Megatron's DDP keeps each parameter's gradient accumulator node (its grad hook
        # hangs there), made on the default stream at wrap time; the capture's backward runs
        # on a side stream and would sync with it (cudaErrorStreamCaptureImplicit). Drop
        # those nodes for the capture and hook fresh ones after, as DDP's __init__ does.
        self.model.grad_accs.clear()
        graph_layers(self.module, **capture)
        # the warm-up passes' weight gradients went into main_grad (fused accumulation)
        self.model.zero_grad_buffer()
        for p in self.model.module.parameters():
            if p.requires_grad:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self.model._make_backward_post_hook(p))
                self.model.grad_accs.append(acc)

    # `max_tokens` (below): micro-batches by token budget instead of `micro_batch_size` rows;
    # `pack`: each of them run as one packed row (see the module docstring)
    def compute_logprobs(self, batch: RolloutBatch, *, micro_batch_size: int,
                         temperature: float = 1.0, max_tokens: Optional[int] = None,
                         pack: bool = False, replay: bool = True,
                         host_work: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """`replay` (with router_replay on): route by the batch's recorded experts, if any.
        `host_work`: run on this thread once the pass is launched, while the device still works
        through it (before its result is copied to the host)."""
        out, rows = self._run(batch, micro_batch_size=micro_batch_size, forward_only=True,
                              loss_fn=None, temperature=temperature, need_entropy=False,
                              max_tokens=max_tokens, pack=pack, replay=replay)
        return self._from_last_stage(out, "logprobs", batch, rows, host_work=host_work)

    def compute_values(self, batch: RolloutBatch, *, micro_batch_size: int,
                       max_tokens: Optional[int] = None, pack: bool = False,
                       host_work: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """`host_work`: as compute_logprobs'."""
        out, rows = self._run(batch, micro_batch_size=micro_batch_size, forward_only=True,
                              loss_fn=None, temperature=1.0, need_entropy=False,
                              max_tokens=max_tokens, pack=pack)
        return self._from_last_stage(out, "values", batch, rows, host_work=host_work)

    def compute_scores(self, batch: RolloutBatch, *, micro_batch_size: int,
                       max_tokens: Optional[int] = None, pack: bool = False) -> torch.Tensor:
        """Reward model: the scalar head at each row's last response token. (B,)"""
        values = self.compute_values(batch, micro_batch_size=micro_batch_size,
                                     max_tokens=max_tokens, pack=pack)
        last = (batch.response_mask.sum(1) - 1).clamp(min=0)
        return values[torch.arange(batch.batch_size), last]

    def train_step(self, batch: RolloutBatch, loss_fn: LossFn, *, micro_batch_size: int,
                   temperature: float = 1.0, need_entropy: bool = False,
                   lr: Optional[float] = None, max_tokens: Optional[int] = None,
                   keep_logprobs: bool = False, pack: bool = False) -> dict:
        """One optimizer step on `batch` (this rank's share of a mini-batch). With `lr`, the step
        uses that fixed rate and leaves the LR schedule where it is (supervised warm-up). When any
        gradient is inf/NaN on any rank the weights, optimizer state and schedule stay as they were
        and the metrics say `update_skipped` = 1 (the caller decides whether to go on).
        `keep_logprobs`: also return the forward's detached log-probs, (B, R) in `batch`'s row
        order, as metrics["logprobs"] (the old policy's when this is the step's only update)."""
        assert self.trainable
        if self._grad_release is not None:
            self._grad_release.restore()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out, rows = self._run(batch, micro_batch_size=micro_batch_size, forward_only=False,
                              loss_fn=loss_fn, temperature=temperature, need_entropy=need_entropy,
                              max_tokens=max_tokens, keep_logprobs=keep_logprobs, pack=pack)
        logprobs = self._from_last_stage(out, "logprobs", batch, rows) if keep_logprobs else None
        out = [{k: v for k, v in o.items() if k != "logprobs"} for o in out]
        scheduled = [g["lr"] for g in self.optimizer.param_groups]
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        used_lr = self.optimizer.param_groups[0]["lr"]
        with record_function("engine.optimizer"):
            finite = self._grads_finite()
            if self._opt_offload is not None:  # the update's activations are freed by now
                self._opt_offload.to_device()
            use_fused_adam(self.optimizer)
            # bf16 has no loss scaler to catch inf/NaN: Megatron's clip then skips clipping (a NaN
            # norm fails `coeff < 1`) and Adam writes NaN into every weight. Skip the step instead.
            ok, grad_norm, _ = self.optimizer.step() if finite else (False, None, None)
        if self._opt_offload is not None:
            self._opt_offload.to_host()
        if self._param_offload is not None:  # the host copy is stale from here on
            self._param_offload.mark_changed()
        if self._grad_release is not None:
            self._grad_release.release()
        if lr is not None:
            for g, value in zip(self.optimizer.param_groups, scheduled):
                g["lr"] = value
        elif ok:
            self.scheduler.step(increment=1)
        metrics = _sum_metrics(out, self.ctx)
        if self._router_stats is not None:  # the routers' losses (megatron's tracker) and loads
            from hybridflow.models.moe import router_metrics

            metrics.update(router_metrics(self.ctx, num_micro_batches=self._n_micro))
            metrics.update(self._router_stats.metrics())
        metrics.update(self.replay_metrics("moe/router_mismatch_frac_update"))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = used_lr
        metrics["update_skipped"] = 0.0 if finite else 1.0
        if self._want_graphs:
            metrics["graphed_micro_batch_frac"] = self.graphed / max(len(out), 1)
        if logprobs is not None:
            metrics["logprobs"] = logprobs
        return metrics

    def _grads_finite(self) -> bool:
        """Whether every gradient is finite on every rank: one flag all-reduced (MIN) over the
        world, since TP/PP ranks hold different shards and DP ranks must skip a step together."""
        bufs = self.model.buffers + self.model.expert_parallel_buffers
        flag = torch.ones(1, device=self.device)
        for b in bufs:
            flag.mul_(torch.isfinite(b.grad_data).all())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _from_last_stage(self, outs: list, key: str, batch: RolloutBatch,
                         rows: Optional[torch.Tensor],
                         host_work: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """Per-micro-batch results (b, R_mb) as one (B, R) tensor in the batch's row order (`rows`:
        see `_micro_batches`), broadcast from the last PP stage. Columns a micro-batch did not
        compute (past its own longest response) are 0: padding, masked by every consumer.
        `host_work` runs after the last launch and before the copy to the host, which waits."""
        width = batch.response_ids.shape[1]
        ctx = self.ctx
        if ctx.is_pp_last_stage:
            parts = [o[key][:, :width].float() for o in outs]
            t = torch.cat([F.pad(v, (0, width - v.shape[1])) for v in parts], dim=0)
            if rows is not None:  # (a pageable host copy is staged at once: no wait for the
                # pass, so `host_work` below runs while the device still computes it)
                t = torch.empty_like(t).index_copy_(0, rows.to(t.device, non_blocking=True), t)
            t = t.contiguous()
        else:
            t = torch.empty((batch.batch_size, width), dtype=torch.float32, device=self.device)
        if ctx.pp_size > 1:
            dist.broadcast(t, src=ctx.pp_last_rank, group=ctx.pp_group)
        if host_work is not None:
            host_work()
        return t.cpu()


class AdapterFreeReference:
    """The reference policy of a LoRA actor: the actor's own model with its adapters off (the
    base weights; no second model). Offload is a no-op: there is nothing of its own to move."""

    role = "ref"
    trainable = False
    optimizer = scheduler = None

    def __init__(self, actor: Engine):
        self.actor = actor
        self.model_cfg = actor.model_cfg

    def compute_logprobs(self, batch: RolloutBatch, **kwargs) -> torch.Tensor:
        # the base model routes by its own router (the rollout's routing is the policy's)
        with adapters_disabled(self.actor.module):
            return self.actor.compute_logprobs(batch, replay=False, **kwargs)

    def offload(self) -> None:
        pass

    def onload(self, *, prefetch: bool = False) -> None:
        pass

    @property
    def last_pass(self) -> Optional[dict]:
        return self.actor.last_pass


class _Staged(NamedTuple):
    """A micro-batch still on the host (Engine._micro_batches(lazy=True)): `pack` (if any) makes
    its packed row (`fitted`: padded to the packed graphs' shape); `_on_device` does that and the
    copy when the schedule runs it."""
    mb: RolloutBatch
    padded: bool
    pack: Optional[Callable[[], PackedRows]] = None
    fitted: bool = False


def _pass_shape(micro: list) -> dict:
    """A pass's micro-batches (`_Staged`) and the tokens of its smallest (packed: its real
    tokens; else its rows x widths), for the step's metrics (Trainer.pass_metrics)."""
    tokens = [int(s.mb.prompt_mask.sum() + s.mb.response_mask.sum()) if s.pack is not None
              else s.mb.prompt_mask.numel() + s.mb.response_mask.numel() for s in micro]
    return {"micro_batches": len(tokens), "smallest_micro_batch_tokens": min(tokens, default=0)}


def _pack_fitted(pack: Callable[[], PackedRows], shape: PackedShape) -> PackedRows:
    fitted = fit_packed(pack(), shape)
    assert fitted is not None, "planned to fit by its row lengths (packing.fits)"
    return fitted


def _on_device(item, device) -> tuple:
    if not isinstance(item, _Staged):
        return item
    mb, packed = to_device([item.mb, None if item.pack is None else item.pack()], device)
    return mb, item.padded, packed


@functools.cache
def _print_once(line: str) -> None:
    print(line, flush=True)


def _lm_head(pred, targets, *, tp_group, temperature, true_vocab, entropy):
    res = vocab_parallel_logprobs(pred, targets, tp_group=tp_group,
                                  true_vocab_size=true_vocab, temperature=temperature,
                                  with_entropy=entropy)
    if entropy:
        return {"logprobs": res[0], "entropy": res[1]}
    return {"logprobs": res}


def _summed(outs: list, keys: list, dev) -> torch.Tensor:
    """(len(keys),) float64 on `dev`: each key's values summed over `outs`, added on the device
    (a read of each micro-batch's metric would wait for the GPU once per value)."""
    if not keys:
        return torch.zeros(0, dtype=torch.float64, device=dev)

    def on_device(v):  # a host number as a fill kernel's argument, not a copy from the host
        if isinstance(v, torch.Tensor):
            return v.detach().reshape(()).to(dev, torch.float64)
        return torch.full((), float(v), dtype=torch.float64, device=dev)

    vals = [on_device(o[k]) for o in outs for k in keys]
    return torch.stack(vals).view(len(outs), len(keys)).sum(0)


def _sum_metrics(outs: list, ctx: ParallelContext) -> dict:
    """Per-micro-batch metric contributions summed over micro-batches and DP ranks (last stage),
    then shared with the other PP stages."""
    dev = ctx.device
    keys = sorted(outs[0].keys()) if outs else []
    vec = _summed(outs, keys, dev)
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
