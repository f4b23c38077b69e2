"""LoRA adapters on the decoder's tensor-parallel linears: PEFT's math on Megatron's fused layout.

`apply_lora(model, cfg)` gives each targeted linear of every decoder layer a `LoRAAdapter` child
(`<linear>.lora`, parameters `lora.A.<peft name>` and `lora.B.<peft name>`) and freezes every
other parameter, so DDP's grad buffers and the optimizer hold only the adapters. The lean linears
(models/linear.py) add `adapter(x)` to their output while `adapter.enabled`, inside one GEMM
(`LoRAAdapter.add_to`: out + h (scale B)^T as addmm, h = dropout(x) A^T).

Targets are PEFT's module names, mapped onto Megatron's fused linears:
    q_proj, k_proj, v_proj -> linear_qkv  (rows grouped per query group: [q heads of g; k_g; v_g])
    o_proj -> linear_proj;  gate_proj, up_proj -> linear_fc1 ([gate; up]);  down_proj -> linear_fc2
Each PEFT target keeps its own (A, B) pair of rank r, exactly PEFT's, so `q_proj` alone adapts only
the q rows of the fused QKV output and export is a reshape. The update is
`B @ A * alpha / r` applied to dropout(x), as PEFT (no rsLoRA); B starts at zero, A at PEFT's
kaiming-uniform(a=sqrt(5)), drawn from a generator seeded per (seed, layer, target) over the FULL
matrix and then sliced, so the start does not depend on TP.

Tensor parallelism (TP = t):
  column-parallel base (qkv, fc1): A (r, in) replicated, B (out/t, r) split by output rows. h = x A^T
    is computed on the layer's own input: without SP, h goes through copy-to-TP (identity forward,
    all-reduce backward: A's gradient sums every rank's B rows, identical on all ranks); with SP, x
    is this rank's sequence slice and h is gathered over the sequence (backward reduce-scatters),
    A's gradient is then a partial sum and A is tagged `sequence_parallel`, which Megatron's
    finalize_model_grads all-reduces over TP (as it does for the norms).
  row-parallel base (proj, fc2): A (r, in/t) split by input, B (out, r) replicated. h = x_local A^T is
    a partial sum: all-reduced over TP (SP: reduce-scattered over the sequence, B tagged
    `sequence_parallel`), then B is applied to the full h. The delta is added after the base's own
    reduction.
The rank-r collectives are tiny next to the base's. Split factors carry Megatron's
tensor-parallel attributes (grad-norm, checkpoints shard them along that axis).

Generation: `merged_adapters(model)` adds B @ A * scale into the base weights for the duration of
a `with` (the weights the generator reads) and restores them bit-exactly after: unmerging
`round(round(W + D) - D)` misses W by an ulp where rounding moved, and those positions are found at
merge time (comparing bits) and their original values kept in host memory (6 bytes each: an int32
offset and the bf16 value; in bf16 about 1% of positions for an update of 0.5% of the weights'
scale, 5% at 5%, 22% at 50%). D is recomputed for the unmerge with the same ops on the same inputs (bitwise
reproducible on one device). The work goes in blocks of rows, so its fp32 temporaries are a few
blocks, not a weight; the host waits for the positions once per many weights, not per block.
The reference policy is the same model under `adapters_disabled(model)`.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)

from hybridflow.models.graphs import capturing
from hybridflow.models.linear import (LeanColumnParallelLinear, LeanRowParallelLinear, _CopyToTP,
                                      accumulate_wgrad)

# PEFT module name -> (Megatron linear of the layer, its attribute path)
PEFT_TARGETS = {
    "q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2",
}
PEFT_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ADAPTER_TAG = ".lora."


def is_adapter_name(name: str) -> bool:
    return ADAPTER_TAG in name or name.startswith("lora.")


def resolve_targets(target_modules, *, key: str = "actor.lora.target_modules") -> tuple[str, ...]:
    """PEFT target names (or "all-linear") -> the PEFT names, in PEFT_TARGETS order; `key`: the
    option named by the error."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if "all-linear" in names:
        return tuple(PEFT_TARGETS)
    unknown = [n for n in names if n not in PEFT_TARGETS]
    if unknown or not names:
        raise ValueError(f"{key}={names}: expected a non-empty list of "
                         f"{list(PEFT_TARGETS)} or ['all-linear']")
    return tuple(n for n in PEFT_TARGETS if n in names)


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of one (fused) TP linear; `parts`: [(peft name, rows per group,
    targeted)] in the fused output order, repeated `groups` times (qkv: per local query group)."""

    def __init__(self, *, kind: str, parts: list, groups: int, in_local: int, in_full: int,
                 rank: int, alpha: float, dropout: float, tp_group, tp_rank: int,
                 sequence_parallel: bool, dtype, device, seeds: dict):
        super().__init__()
        assert kind in ("column", "row")
        self.kind, self.parts, self.groups = kind, parts, groups
        self.rank, self.scale = rank, alpha / rank
        self.tp_group, self._tp = tp_group, tp_group.size()
        self.sp = sequence_parallel and self._tp > 1
        self.drop = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.enabled = True
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for name, rows, targeted in parts:
            if not targeted:
                continue
            full_a = torch.empty(rank, in_full)
            gen = torch.Generator().manual_seed(seeds[name])
            torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=gen)
            if kind == "row":  # A split by input columns
                full_a = full_a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
            a = torch.nn.Parameter(full_a.to(device=device, dtype=dtype).contiguous())
            b = torch.nn.Parameter(torch.zeros(groups * rows, rank, device=device, dtype=dtype))
            split, replicated = (b, a) if kind == "column" else (a, b)
            set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
            setattr(replicated, "sequence_parallel", self.sp)
            self.A[name], self.B[name] = a, b

    def tp_axes(self) -> dict:
        """{state-dict key under this module: TP axis} of its split factors."""
        if self.kind == "column":
            return {f"B.{n}": 0 for n in self.B}
        return {f"A.{n}": 1 for n in self.A}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update for the linear's own input `x` (column: (s, b, in), s/t under SP; row:
        (s, b, in/t)); returns what to add to its output (`add_to` adds it in the same GEMM)."""
        h = self._low_rank(x)
        return F.linear(h, self.b_matrix())

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + forward(x) as one GEMM with the sum in its epilogue (addmm, beta = 1): the
        output-sized tensor is read and written once, with no scaled, concatenated or zero-filled
        copy of the update in between, forward or backward."""
        h = self._low_rank(x)
        n = out.shape[-1]
        return torch.addmm(out.reshape(-1, n), h.reshape(-1, h.shape[-1]),
                           self.b_matrix().t()).view(out.shape)

    def fusable(self, layer, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        """Whether `fused_linear` computes `layer`'s output (base and update) here: TP = 1, no
        dropout in this pass and a frozen base; in a pass that trains the factors, also
        parallel.gradient_accumulation_fusion on `layer` and DDP's main_grad on every factor
        (looked up once per pass inside `factors_fixed`)."""
        if self._tp != 1 or (isinstance(self.drop, torch.nn.Dropout) and self.drop.training) \
                or weight.requires_grad or (bias is not None and bias.requires_grad):
            return False
        factors = self.factors()  # all train or none (apply_lora): the first stands for all
        if not (torch.is_grad_enabled() and factors[0].requires_grad):
            return True
        return layer.fuse_wgrad and self._per_pass(
            "main_grads", lambda: all(hasattr(p, "main_grad") for p in factors))

    def factors(self) -> list:
        """[A factors..., B factors...] in `a_matrix` / `b_matrix` order (the Parameter objects,
        listed once: moves, dtype casts and loads keep them)."""
        found = self.__dict__.get("_factors")
        if found is None:
            found = self.__dict__["_factors"] = [*self.A.values(), *self.B.values()]
        return found

    def gemm_plan(self) -> "_GemmPlan":
        """What the fused GEMMs read (`_GemmPlan`), made from the factors without autograd; inside
        `factors_fixed` made once and reused (the micro-batches of a pass do not rebuild the
        concatenated and zero-padded matrices, nor list the main_grads, for every linear)."""
        return self._per_pass("plan", lambda: _GemmPlan(self))

    def _per_pass(self, key: str, make):
        """make(), inside `factors_fixed` made at the first call and kept to the end of the pass,
        but not while a CUDA graph is captured (its replays must make it anew); else each call."""
        memo = self.__dict__.get("_pass")
        if memo is None:
            return make()
        if key not in memo:
            made = make()
            if not capturing():
                memo[key] = made
            return made
        return memo[key]

    def fused_linear(self, x: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
        """F.linear(x, weight, bias) + forward(x) where `fusable`: the values of `add_to` on the
        base output (the same GEMMs, the update added in place), as one autograd node whose
        backward adds the factors' gradients into their main_grad (`_FusedLoRALinear`)."""
        plan, first = self.gemm_plan(), self.factors()[0]
        if torch.is_grad_enabled() and first.requires_grad:
            # the first factor only makes autograd record the node (x may need no gradient)
            return _FusedLoRALinear.apply(x, weight, bias, plan.with_grads(), first)
        with torch.no_grad():
            return _base_plus_update(x, weight, bias, plan)[0]

    def _b_index(self, device: torch.device) -> torch.Tensor:
        """Where the B factors' gradients lie in grad^T h ((out_local, k r), h's columns as
        `b_matrix` reads them), as flat indices into it: factor by factor, each in its own
        row-major layout (qkv: its rows in every query group). Made once per device (a layout,
        not values), but not while a CUDA graph is captured (its kernels have not run yet)."""
        found = self.__dict__.get("_b_take")
        if found is not None and found.device == device:
            return found
        names, r = list(self.B), self.rank
        rows = sum(n for _, n, _ in self.parts)
        grid = torch.arange(self.groups * rows * len(names) * r, device=device)
        grid = grid.view(self.groups, rows, len(names) * r)
        blocks, off = [], 0
        for name, n, targeted in self.parts:
            if targeted:
                j = names.index(name)
                blocks.append(grid[:, off:off + n, j * r:(j + 1) * r].reshape(-1))
            off += n
        found = torch.cat(blocks)
        if not capturing():
            self.__dict__["_b_take"] = found
        return found

    def _low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """h = dropout(x) A^T with its TP collective: (s, b, k r), the k targeted parts' r columns
        side by side (column kind: over the full sequence; row: reduced over TP)."""
        h = F.linear(self.drop(x), self.a_matrix())
        if self._tp == 1:
            return h
        if self.kind == "row":  # a partial sum over this rank's input slice
            return (reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                    if self.sp else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return (gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sp
                else _CopyToTP.apply(h, self.tp_group))

    def b_matrix(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """scale * B as one (out_local, k r) matrix over `_low_rank`'s columns: part j's rows (in
        every group) read columns j r..(j + 1) r, an untargeted part's rows are zero (one zero-fill
        and a copy per part). `dtype`: the factors cast first (the merge's fp32), else their own."""
        names = list(self.B)
        first = self.B[names[0]]
        if self.kind == "row" or (len(self.parts) == 1 and self.groups == 1):
            b = first if dtype is None else first.to(dtype)
            return b * self.scale
        k, r = len(names), self.rank
        rows = sum(n for _, n, _ in self.parts)
        out = first.new_zeros(self.groups, rows, k * r, dtype=dtype)
        off = 0
        for name, n, targeted in self.parts:
            if targeted:
                j = names.index(name)
                out[:, off:off + n, j * r:(j + 1) * r] = self.B[name].view(self.groups, n, r)
            off += n
        return out.view(-1, k * r) * self.scale

    def a_matrix(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The A factors stacked as `_low_rank` multiplies them: (k r, in_local)."""
        a = list(self.A.values())
        a = a[0] if len(a) == 1 else torch.cat(a)
        return a if dtype is None else a.to(dtype)

    def weight_blocks(self, weight: torch.Tensor, rows: int = 4096):
        """(block of `weight`, its rows of b_matrix (fp32), a_matrix (fp32)): row blocks of at most
        `rows` rows covering the base weight, whose update is the product of the two (so that a
        merge's fp32 temporaries are a few blocks, not a weight, in few launches)."""
        b, a = self.b_matrix(torch.float32), self.a_matrix(torch.float32)
        for r0 in range(0, weight.shape[0], rows):
            yield weight[r0:r0 + rows], b[r0:r0 + rows], a

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in the base weight's local layout, fp32: (out_local, in_local)."""
        return self.b_matrix(torch.float32) @ self.a_matrix(torch.float32)


class _GemmPlan:
    """What one adapter's fused GEMMs read (`LoRAAdapter.gemm_plan`): a_matrix (k r, in), the
    scaled b_matrix (out, k r) and their transposes, and, made by the first forward that trains
    the factors, `grads` (`_FactorGrads`: where and how the backward adds their gradients)."""

    def __init__(self, adapter: LoRAAdapter):
        with torch.no_grad():
            self.a, self.b = adapter.a_matrix(), adapter.b_matrix()
        self.at, self.bt = self.a.t(), self.b.t()
        self.adapter, self.grads = adapter, None

    def with_grads(self) -> "_GemmPlan":
        if self.grads is None:
            self.grads = _FactorGrads(self.adapter, self.a.device)
        return self


class _FactorGrads:
    """Where `_FusedLoRALinear.backward` adds one adapter's factor gradients (their main_grad),
    and how, in few launches whatever the main_grads' layout. A: dL/dh^T x as one (k r, in) GEMM
    for all the A factors (as autograd computes it), its row blocks added by one `_foreach_add_`
    (one GEMM straight into main_grad for a single factor). B: a factor over all the output rows
    (row kind) takes one GEMM; else grad^T h (out, k r) is one GEMM, the blocks the B factors read
    are gathered from it (one `take`) and added by one `_foreach_add_`, with the scale as its
    alpha."""

    def __init__(self, ad: LoRAAdapter, device: torch.device):
        self.scale, self.rank = ad.scale, ad.rank
        self.a = [p.main_grad for p in ad.A.values()]
        b = [p.main_grad for p in ad.B.values()]
        self.b_whole = b[0] if ad.kind == "row" or (len(ad.parts) == 1 and ad.groups == 1) \
            else None
        if self.b_whole is None:
            self.b = [g.view(-1) for g in b]
            self.b_sizes = [g.numel() for g in b]
            self.b_take = ad._b_index(device)

    def add_a(self, gh: torch.Tensor, x: torch.Tensor) -> None:
        """A's main_grads += gh (N, k r: dL/dh)^T @ x (N, in)."""
        if len(self.a) == 1:
            accumulate_wgrad(self.a[0], gh, x)
        else:
            grads = _wgrad(gh, x, self.a[0].dtype)
            torch._foreach_add_(self.a, grads.split(self.rank))

    def add_b(self, grad: torch.Tensor, h: torch.Tensor) -> None:
        """B's main_grads += scale * (their rows of grad (N, out))^T @ (their columns of h)."""
        if self.b_whole is not None:
            accumulate_wgrad(self.b_whole, grad, h, alpha=self.scale)
            return
        blocks = _wgrad(grad, h, self.b[0].dtype).take(self.b_take)
        torch._foreach_add_(self.b, blocks.split(self.b_sizes), alpha=self.scale)


def _wgrad(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad (N, out)^T @ x (N, in) in `dtype` (main_grad's): accumulated in it by one GEMM on CUDA;
    on CPU (no mixed-dtype GEMM) in the inputs' dtype, then cast."""
    if grad.dtype == dtype:
        return grad.t().mm(x)
    if grad.is_cuda:
        return torch.mm(grad.t(), x, out_dtype=dtype)
    return grad.t().mm(x).to(dtype)


def _base_plus_update(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      plan: _GemmPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x W^T + bias + (x a^T) b^T, x as (N, in), h = x a^T as (N, k r)): `add_to`'s GEMMs, the
    update added into the base output in place (no output-sized copy; the output is the base
    GEMM's own tensor, not a view)."""
    out = F.linear(x, weight, bias)
    x2d = x.reshape(-1, x.shape[-1])
    h = x2d.mm(plan.at)
    out.view(-1, out.shape[-1]).addmm_(h, plan.bt)
    return out, x2d, h


class _FusedLoRALinear(torch.autograd.Function):
    """A frozen TP = 1 linear with its adapter as ONE autograd node (`LoRAAdapter.fused_linear`).

    The autograd path (`add_to`) is ~25 nodes per adapted linear (A's concat, B's zero-fill and
    copies, the scale, views, the two GEMMs) plus an AccumulateGrad and a Python DDP hook
    (main_grad += grad) per factor, and a separate input-gradient sum: at 7 targets that doubled a
    layer's backward ops, and a small model's packed update waits on the host for them. Here:
    forward = the base GEMM, h = x A^T, out += h (scale B)^T in place; backward = the input
    gradient as grad W + (grad scale B) A in two GEMMs accumulating into one tensor, and the
    factors' gradients added into DDP's fp32 main_grad by their GEMMs (`_FactorGrads`, with
    models/linear.py `accumulate_wgrad`, as parallel.gradient_accumulation_fusion does for trained
    weights); autograd gets none for them, so no hook runs. Forward values are `add_to`'s (same
    GEMMs, same order), and so are the gradients on CPU (the same GEMMs). A small model's update
    waits on the host for every op dispatched here, so they are few: 5 top-level aten ops forward
    (3 GEMMs), 9 backward for a row-parallel linear (4 GEMMs), 14 for qkv or fc1 (5 GEMMs, a
    `take` and 2 `_foreach_add_`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, first_factor):
        out, x2d, h = _base_plus_update(x, weight, bias, plan)
        ctx.save_for_backward(x2d, weight, h)
        # the plan holds the main_grad buffers themselves (activation recompute hands backward
        # copies of the saved tensors)
        ctx.plan, ctx.x_shape = plan, x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x2d, weight, h = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.reshape(-1, grad.shape[-1])
        gh = grad.mm(plan.b)  # dL/dh (b holds the scale)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.mm(weight).addmm_(gh, plan.a).view(ctx.x_shape)
        plan.grads.add_a(gh, x2d)
        plan.grads.add_b(grad, h)
        return grad_x, None, None, None, None


def _seed(seed: int, layer: int, name: str, salt: str = "") -> int:
    return zlib.crc32(f"{salt}{seed}/{layer}/{name}".encode()) & 0x7FFFFFFF


def apply_lora(model, *, rank: int, alpha: float, dropout: float, target_modules,
               seed: int = 0, salt: str = "", key: str = "actor.lora") -> int:
    """Adapt `model`'s decoder layers (this PP stage's) in place; freeze everything else.
    `salt` makes another role's A factors differ from the actor's at the same seed (the critic's:
    "critic/"); `key`: the option named by errors. Returns the number of adapter parameters
    (elements) on this rank."""
    targets = resolve_targets(target_modules, key=f"{key}.target_modules")
    cfg = model.config
    hd = cfg.kv_channels
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    hpg = heads // groups
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for layer in model.decoder.layers:
        index = layer.layer_number - 1  # global (over pipeline stages), 0-based
        for path in dict.fromkeys(PEFT_TARGETS[t] for t in targets):
            linear = layer.get_submodule(path)
            if type(linear) not in (LeanColumnParallelLinear, LeanRowParallelLinear):
                raise ValueError(f"{key} needs the local layer spec's lean linears "
                                 "(model.attention_backend=sdpa or auto without "
                                 f"transformer-engine); {path} is {type(linear).__name__}")
            group = linear.tp_group
            tp, tp_rank = group.size(), group.rank()
            mine = [t for t in PEFT_TARGETS if PEFT_TARGETS[t] == path]
            out_local, in_local = linear.weight.shape
            if path.endswith("linear_qkv"):
                kind, g = "column", groups // tp
                parts = [("q_proj", hpg * hd), ("k_proj", hd), ("v_proj", hd)]
            elif path.endswith("linear_fc1"):
                kind, g = "column", 1
                parts = [("gate_proj", out_local // 2), ("up_proj", out_local // 2)]
            else:
                kind, g = "row", 1
                parts = [(mine[0], out_local)]
            parts = [(n, rows, n in targets) for n, rows in parts]
            assert sum(r for _, r, _ in parts) * g == out_local, (path, parts, out_local)
            adapter = LoRAAdapter(
                kind=kind, parts=parts, groups=g, in_local=in_local,
                in_full=in_local * (tp if kind == "row" else 1), rank=rank, alpha=alpha,
                dropout=dropout, tp_group=group, tp_rank=tp_rank,
                sequence_parallel=cfg.sequence_parallel, dtype=linear.weight.dtype,
                device=linear.weight.device,
                seeds={n: _seed(seed, index, n, salt) for n, _, t in parts if t})
            linear.lora = adapter
            count += sum(p.numel() for p in adapter.parameters())
    return count


def adapters(model) -> Iterator[tuple[torch.nn.Module, LoRAAdapter]]:
    """(linear, its adapter) for every adapted linear of `model`."""
    for m in model.modules():
        a = m._modules.get("lora") if hasattr(m, "_modules") else None
        if isinstance(a, LoRAAdapter):
            yield m, a


def has_adapters(model) -> bool:
    return next(adapters(model), None) is not None


@contextmanager
def factors_fixed(model):
    """Inside the `with` the factors of `model`'s adapters do not change (a pass's forwards and
    backwards, before its optimizer step): each adapter makes what its fused GEMMs read once
    (`gemm_plan`), and drops it on exit. Outside, every forward makes it anew: the optimizer
    writes the factors through `.data`, which no version counter sees."""
    found = [a for _, a in adapters(model)]
    for a in found:
        a.__dict__["_pass"] = {}
    try:
        yield
    finally:
        for a in found:
            a.__dict__.pop("_pass", None)


@contextmanager
def adapters_disabled(model):
    """The base model: every adapter of `model` off inside the `with` (the reference policy)."""
    found = list(adapters(model))
    before = [a.enabled for _, a in found]
    for _, a in found:
        a.enabled = False
    try:
        yield
    finally:
        for (_, a), on in zip(found, before):
            a.enabled = on


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@torch.no_grad()
def merged_copy(adapter: LoRAAdapter, weight: torch.Tensor, *, block_rows: int = 4096,
                inplace: bool = False) -> torch.Tensor:
    """A copy of `weight` (the adapted linear's, any device; `inplace`: `weight` itself, a copy
    already) holding the bits `merged_adapters` writes into it: W + scale * B @ A rounded to its
    dtype, by the same ops in the same blocks."""
    out = weight if inplace else weight.clone()
    for w, b, a in adapter.weight_blocks(out, block_rows):
        w.copy_((w.float() + b @ a).to(w.dtype))
    return out


@contextmanager
def merged_adapters(model, *, block_rows: int = 4096, sync_elements: int = 1 << 26):
    """Inside the `with`, each adapted linear's weight holds W + scale * B @ A (rounded to its
    dtype) and its adapter is off (the forward then equals the adapted one up to that rounding);
    after it, W is restored bit for bit (see the module docstring). Computed `block_rows` rows at
    a time (fp32 temporaries of a few such blocks, not of a whole weight). Finding the positions
    to fix makes the host wait for the device; it does so once per `sync_elements` weights'
    elements (their merged blocks and masks held until then, the masks joined for the wait: 4
    bytes an element at most), not once per block. The positions and their old values go to the
    host without waiting for the copies (pinned memory; the restore's copies back are ordered
    after them on the same stream)."""
    from hybridflow.offload import host_copy  # (offload imports checkpoint, which imports us)

    saved, pending = [], []  # pending: (linear, adapter, its blocks' masks, merged blocks)

    def flush():
        if not pending:
            return
        masks = torch.cat([m for _, _, ms, _ in pending for m in ms])
        wrong = masks.nonzero().squeeze(1)  # the one wait for the device
        sizes = [linear.weight.numel() for linear, _, _, _ in pending]
        ends = torch.tensor(sizes, device=wrong.device).cumsum(0)
        cuts = [0] + torch.searchsorted(wrong, ends).tolist()
        start = 0
        for (linear, a, _, merged), lo, hi, n in zip(pending, cuts, cuts[1:], sizes):
            w = linear.weight
            local = wrong[lo:hi] - start
            # kept on the host: int32 offsets in the weight and the old values
            fixes = (host_copy(local.to(torch.int32), non_blocking=True),
                     host_copy(w.view(-1)[local], non_blocking=True))
            for (block, _, _), m in zip(a.weight_blocks(w, block_rows), merged):
                block.copy_(m)
            a.enabled = False
            saved.append((linear, a, fixes))
            start += n
        pending.clear()

    try:
        with torch.no_grad():
            for linear, a in adapters(model):
                if not a.enabled:
                    continue
                masks, merged = [], []
                for w, b, at in a.weight_blocks(linear.weight, block_rows):
                    d = b @ at
                    m = (w.float() + d).to(w.dtype)
                    back = (m.float() - d).to(w.dtype)
                    masks.append((_bits(back) != _bits(w)).view(-1))
                    merged.append(m)
                pending.append((linear, a, masks, merged))
                if sum(lin.weight.numel() for lin, *_ in pending) >= sync_elements:
                    flush()
            flush()
        yield
    finally:
        with torch.no_grad():
            for linear, a, (wrong, keep) in reversed(saved):
                a.enabled = True
                w = linear.weight
                for block, b, at in a.weight_blocks(w, block_rows):
                    block.copy_((block.float() - b @ at).to(block.dtype))
                w.view(-1)[wrong.to(w.device, torch.long, non_blocking=True)] = keep.to(
                    w.device, non_blocking=True)

