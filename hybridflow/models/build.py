"""Build the Megatron GPTModel of each role from a `ModelConfig`.

Roles: `actor` and `ref` get the LM head; `critic` and `reward` get a scalar head (`ValueHead`) in
place of the vocab-parallel output layer. All roles share one layer spec:
- transformer-engine installed and `attention_backend` auto/te: Megatron's TE spec;
- otherwise Megatron's local spec with `SDPAttention` (PyTorch SDPA, flash kernels on GPU) as the core
  attention and torch RMSNorm, tagged for sequence parallelism (torch's norm refuses SP itself:
  its params are marked so Megatron all-reduces their grads over TP, which is exactly what SP needs),
  and lean TP linears (`hybridflow/models/linear.py`: Megatron's params, plain `F.linear` compute).
  `attention_backend=local` keeps Megatron's own unfused DotProductAttention (for comparisons).
Llama/Qwen2/Qwen3/Mistral are one architecture here: RoPE, RMSNorm, SwiGLU MLP, GQA, optional QKV
bias, tied or untied embeddings, optional per-head q/k RMSNorm (`qk_layernorm`, Qwen3: Megatron's
`q_layernorm` / `k_layernorm` slots of SelfAttention, RMSNorm over head_dim with the model's epsilon,
applied before RoPE; their weights are replicated over TP, and TransformerConfig.qk_layernorm makes
`finalize_model_grads` sum their gradients over TP, each rank holding only its own heads' part).
The vocabulary is padded to a multiple of TP (x128 for real vocabularies); padded logits are masked
by the log-prob and sampling code.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig

from hybridflow.config import ModelConfig
from hybridflow.models.attention import SDPAttention
from hybridflow.models.fused import use_fused_rope, use_fused_swiglu, use_rope_from_qkv
from hybridflow.models.heads import ValueHead
from hybridflow.models.linear import (LeanColumnParallelLinear, LeanOutputLinear,
                                      LeanRowParallelLinear)
from hybridflow.models.quack_mlp import QuackMLP

LM_ROLES = ("actor", "ref")
SCALAR_ROLES = ("critic", "reward")


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = tp * (128 if vocab_size >= 1024 else 1)
    return -(-vocab_size // multiple) * multiple


def moe_fields(cfg: ModelConfig, *, ep: int = 1, etp: Optional[int] = None) -> dict:
    """TransformerConfig's MoE fields for `cfg.moe` (none for a dense model). Qwen3-MoE's router
    (softmax over all experts, top-k, renormalised when norm_topk_prob) is Megatron's softmax
    router with the top-k taken on the logits first (moe_router_pre_softmax=False: the softmax
    over the k chosen logits is the renormalised probabilities); without norm_topk_prob, softmax
    first (pre_softmax=True), no renormalisation. No capacity: no token is dropped."""
    m = cfg.moe
    if not m.enabled:
        return {}
    return dict(
        num_moe_experts=m.num_experts, moe_router_topk=m.top_k,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size or None,
        moe_router_pre_softmax=not m.norm_topk_prob, moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if m.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=m.aux_loss_coeff, moe_z_loss_coeff=m.z_loss_coeff or None,
        moe_router_dtype=m.router_dtype, moe_token_dispatcher_type=m.token_dispatcher,
        moe_expert_capacity_factor=None, moe_grouped_gemm=have_te(),
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def transformer_config(cfg: ModelConfig, *, tp: int, pp: int, sequence_parallel: bool,
                       precision: str, fused_elementwise: bool = False, ep: int = 1,
                       etp: Optional[int] = None) -> TransformerConfig:
    """`fused_elementwise` (with CUDA): Megatron's fused SwiGLU (models/fused.py). `ep` / `etp`:
    the MoE layers' expert parallel / expert TP sizes (etp None: tp)."""
    bf16 = precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        **moe_fields(cfg, ep=ep, etp=etp or tp),
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
        normalization="RMSNorm", layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias, qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel, params_dtype=dtype, bf16=bf16, pipeline_dtype=dtype,
        bias_activation_fusion=fused_elementwise and torch.cuda.is_available(),
        masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        attention_softmax_in_fp32=True, init_method_std=0.02,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
    )


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with Megatron's norm constructor signature; its parameters SP-tagged (see
    the module doc)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype,
                         device="cuda" if torch.cuda.is_available() else "cpu")
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)


def layer_spec(cfg: ModelConfig) -> ModuleSpec:
    backend = cfg.attention_backend
    experts = cfg.moe.num_experts if cfg.moe.enabled else None
    if experts is not None:
        from hybridflow.models.moe import without_te_fix

        without_te_fix()
    if backend == "te" and not have_te():
        raise ValueError("model.attention_backend=te needs transformer-engine and a GPU "
                         "(pip install 'hybridflow[gpu]')")
    if backend == "te" or (backend == "auto" and have_te()):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec)

        return get_gpt_layer_with_transformer_engine_spec(
            normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm, num_experts=experts,
            moe_grouped_gemm=experts is not None)  # TEGroupedMLP: grouped GEMM on the GPU
    # MoE without TE: Megatron's SequentialMLP (one expert's GEMMs at a time over the tokens
    # routed to it; runs on CPU and GPU); the attention as below
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm,
                                    num_experts=experts, moe_grouped_gemm=False)
    spec.submodules.input_layernorm = TorchRMSNorm
    spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    if cfg.qk_layernorm:  # built by SelfAttention with hidden_size=head_dim, eps=norm_epsilon
        attn = spec.submodules.self_attention.submodules
        attn.q_layernorm = attn.k_layernorm = TorchRMSNorm
    if backend in ("auto", "sdpa"):
        attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
        attn.core_attention = SDPAttention
        attn.linear_qkv, attn.linear_proj = LeanColumnParallelLinear, LeanRowParallelLinear
        if experts is None:  # the experts keep Megatron's linears (expert TP groups)
            mlp.linear_fc1, mlp.linear_fc2 = LeanColumnParallelLinear, LeanRowParallelLinear
    return spec


def build_model(cfg: ModelConfig, *, role: str, ctx, sequence_parallel: bool = False,
                precision: str = "fp32", activation_checkpointing: bool = False,
                fused_elementwise: bool = False, quack_mlp: bool = False,
                swiglu_backward: str = "compiled", rope_from_qkv: bool = False) -> GPTModel:
    """One pipeline stage of the model for `role` on this rank, in the training layout of the
    `ParallelContext` `ctx` (its groups are the model's). `activation_checkpointing`: every
    decoder layer recomputes its forward in backward (`checkpoint_layers`).
    `fused_elementwise` (parallel.fused_elementwise): RoPE and SwiGLU as fused kernels on CUDA
    (models/fused.py); `swiglu_backward` (parallel.swiglu_backward) picks the SwiGLU's backward;
    `rope_from_qkv` (parallel.rope_from_qkv): the RoPE reads q in the QKV projection's groups.
    `quack_mlp` (parallel.mlp_kernels, resolved): the dense MLPs' SwiGLU inside quack's GEMMs
    where they apply (models/quack_mlp.py)."""
    if role not in LM_ROLES + SCALAR_ROLES:
        raise ValueError(f"role={role!r} is not one of {LM_ROLES + SCALAR_ROLES}")
    tp, pp, pp_rank = ctx.tp_size, ctx.pp_size, ctx.train.pp
    tcfg = transformer_config(cfg, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                              precision=precision, fused_elementwise=fused_elementwise,
                              ep=ctx.ep_size, etp=_group_size(getattr(ctx.pgs, "expt_tp", None)))
    use_fused_rope(fused_elementwise)  # process-wide: the last model built sets it
    use_fused_swiglu(fused_elementwise and swiglu_backward == "triton")  # process-wide, alike
    use_rope_from_qkv(fused_elementwise and rope_from_qkv)  # needs the fused RoPE above
    spec = layer_spec(cfg)
    block = TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(tcfg, None, pp_rank),
        layer_norm=TorchRMSNorm if spec.submodules.input_layernorm is TorchRMSNorm else None)
    if block.layer_norm is None:  # TE spec: let Megatron pick its fused norm
        block = spec
    pre, post = pp_rank == 0, pp_rank == pp - 1
    scalar = role in SCALAR_ROLES
    rope_scaling = cfg.rope_scaling or {}
    model = GPTModel(
        config=tcfg, transformer_layer_spec=block,
        vocab_size=padded_vocab_size(cfg.vocab_size, tp),
        max_sequence_length=cfg.max_position_embeddings, pre_process=pre, post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings and not scalar,
        position_embedding_type="rope", rotary_base=int(cfg.rotary_base),
        rope_scaling=rope_scaling.get("rope_type") == "llama3",
        rope_scaling_factor=float(rope_scaling.get("factor", 8.0)), pg_collection=ctx.pgs,
    )
    if torch.cuda.is_available():  # megatron-core's MoE routers create their weight on the host
        for param in model.parameters():  # (moved only at their first forward: after the
            if param.device.type == "cpu":  # optimizer and DDP buffers were built)
                param.data = param.data.to(torch.cuda.current_device())
    model.role = role
    model.true_vocab_size = cfg.vocab_size
    if scalar and post:
        model.output_layer = ValueHead(tcfg, tp_group=ctx.tp_group)
    elif post:  # batch-major logits (no transpose copies), computed where they are scored
        LeanOutputLinear.adopt(model.output_layer)  # (its `select`) under every layer spec
    if quack_mlp:
        QuackMLP.adopt(model)
    if activation_checkpointing:
        checkpoint_layers(model)
    return model


def _group_size(group) -> Optional[int]:
    import torch.distributed as dist

    return dist.get_world_size(group) if group is not None else None


def checkpoint_layers(model: GPTModel) -> None:
    """Full activation recompute, one layer at a time (parallel.activation_checkpointing; Megatron's
    recompute_granularity=full, method uniform, 1 layer): in training, each decoder layer keeps only
    its input for backward and runs its forward again there (torch's non-reentrant checkpoint, so
    any arguments and the layer's TP/SP collectives re-run as they ran). Forward-only passes (eval
    mode or no grad) run the layer as it is. No RNG state is saved: the layers have no dropout
    (transformer_config sets 0). Megatron's own recompute saves CUDA RNG states, which fails on CPU
    builds of torch. With routing replay (models/moe.py) the recomputation routes by the
    targets its forward was bound to."""
    from torch.utils.checkpoint import checkpoint

    from hybridflow.models.moe import bind_for_recompute

    for layer in model.decoder.layers:
        def forward(*args, _layer=layer, _fwd=layer.forward, **kwargs):
            if not (_layer.training and torch.is_grad_enabled()):
                return _fwd(*args, **kwargs)
            return checkpoint(bind_for_recompute(_layer, _fwd), *args, use_reentrant=False,
                              preserve_rng_state=False, **kwargs)
        layer.forward = forward
