"""The model's shape (`ModelConfig`, the `model` config group) and the counts that follow from it.

One type for every consumer: Hydra composes it from conf/model/*.yaml, `models/hf_config.py` reads it
from a Hugging Face config.json, megatron-core builds the model from it, and the cost model counts
FLOPs and bytes from it (`hybridflow.cost`).

The architecture is the Llama/Qwen2/Qwen3/Mistral decoder that hybridflow builds with megatron-core:
grouped-query attention (QKV with optional bias, output projection without; with `qk_layernorm`,
Qwen3's RMSNorm over head_dim of every query and key head before RoPE, one weight for all query heads
and one for all key heads), a SwiGLU MLP (gate, up: hidden x ffn each, down: ffn x hidden), two
RMSNorms per layer plus a final one, a vocab embedding and an output layer (shared with the embedding
when `tie_word_embeddings`). The counts ignore Megatron's
vocab padding (to a multiple of 128 x TP): it changes them by < 0.1% for the models in conf/.
Validation (positive sizes, TP/PP divisibility) is `hybridflow.config.validate_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class MoEConfig:
    """model.moe: a mixture-of-experts MLP in every decoder layer (Qwen3-MoE) in place of the dense
    SwiGLU MLP; megatron-core's MoELayer (router, token dispatcher, experts). num_experts=0: dense.
    Each expert is a SwiGLU MLP of width `moe_ffn_hidden_size`; a token's output is the sum of its
    top_k experts' outputs weighted by the router's softmax probabilities (renormalised over the
    top_k when `norm_topk_prob`, as Qwen3-MoE's config.json). No token is dropped (no capacity)."""
    num_experts: int = 0  # routed experts per layer (HF num_experts); 0: a dense MLP
    top_k: int = 2  # experts per token (HF num_experts_per_tok)
    moe_ffn_hidden_size: int = 0  # one expert's intermediate width (HF moe_intermediate_size)
    # an always-on shared expert of this width beside the routed ones (0: none, as Qwen3-MoE);
    # training only: the HF mapping and the in-place generator refuse it
    shared_expert_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top_k probabilities to sum to 1 (HF's name)
    # load-balancing loss (Switch Transformer's, Megatron's moe_aux_loss_coeff; HF
    # router_aux_loss_coef) and router z-loss (moe_z_loss_coeff), added to the training loss'
    # gradient by megatron-core's MoE router; 0 turns either off
    aux_loss_coeff: float = 0.001
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE; Megatron's moe_z_loss_coeff)
    router_dtype: str = "fp32"  # the router's logits and softmax: fp32 | fp64 (Megatron's)
    # megatron-core's token dispatcher: alltoall | allgather (both run over gloo and NCCL)
    token_dispatcher: str = "alltoall"

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclass
class ModelConfig:
    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: Optional[int] = None  # head dim; None: hidden_size // num_attention_heads
    vocab_size: int = 64
    max_position_embeddings: int = 256
    rotary_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF-style rope_scaling (llama3) when loaded from a checkpoint
    norm_epsilon: float = 1e-6
    add_qkv_bias: bool = False
    qk_layernorm: bool = False  # RMSNorm of each query / key head before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    hf_path: Optional[str] = None  # HF checkpoint dir (safetensors + config.json)
    gguf_path: Optional[str] = None  # GGUF file (llama.cpp); see hybridflow.models.gguf
    hf_architecture: Optional[str] = None  # e.g. Qwen2ForCausalLM: kept for the HF export
    attention_backend: str = "auto"  # auto | sdpa | te | local
    moe: MoEConfig = field(default_factory=MoEConfig)  # num_experts=0: a dense MLP

    def __post_init__(self):
        if isinstance(self.moe, dict):  # from JSON (checkpoints) or a plain mapping
            self.moe = MoEConfig(**self.moe)
        elif self.moe is None:
            self.moe = MoEConfig()

    # ----- widths -----
    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:  # width of Q and of the attention output
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # width of K (and of V)
        return self.num_query_groups * self.head_dim

    # ----- parameter counts -----
    @property
    def attn_matmul_params(self) -> int:
        h = self.hidden_size
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h

    @property
    def mlp_matmul_params(self) -> int:
        """Weights of one layer's MLP that one token multiplies: dense SwiGLU 3 h f; MoE: the
        router (h x E) + top_k experts + the shared expert (active, not total, parameters)."""
        return self._mlp_weights(self.moe.top_k)

    @property
    def mlp_params(self) -> int:
        """Weights of one layer's MLP held in memory (MoE: every expert)."""
        return self._mlp_weights(self.moe.num_experts)

    def _mlp_weights(self, experts: int) -> int:
        """Dense SwiGLU 3 h f; MoE: the router (h x E) + `experts` experts + the shared expert."""
        h, m = self.hidden_size, self.moe
        if not m.enabled:
            return 3 * h * self.ffn_hidden_size
        return h * m.num_experts + 3 * h * (experts * m.moe_ffn_hidden_size
                                            + m.shared_expert_ffn_hidden_size)

    @property
    def layer_matmul_params(self) -> int:  # per token (MoE: active experts only)
        return self.attn_matmul_params + self.mlp_matmul_params

    @property
    def layer_params(self) -> int:  # held (MoE: all experts)
        bias = (self.q_dim + 2 * self.kv_dim) if self.add_qkv_bias else 0
        qk_norms = 2 * self.head_dim if self.qk_layernorm else 0
        return (self.attn_matmul_params + self.mlp_params + bias + 2 * self.hidden_size
                + qk_norms)  # + the norms

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_nonembedding_params(self) -> int:  # layers + final norm
        return self.num_layers * self.layer_params + self.hidden_size

    @property
    def num_params(self) -> int:
        out = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_nonembedding_params + self.embedding_params + out

    @property
    def num_critic_params(self) -> int:
        """Same trunk, the output layer replaced by a scalar value head (hidden x 1)."""
        return self.num_nonembedding_params + self.embedding_params + self.hidden_size

    @property
    def num_decode_params(self) -> int:
        """Matmul weights one decode step reads (and, in-place, multiplies every row by): dense,
        num_dense_params; MoE, every expert (the generator's CUDA-graph-safe path runs them all,
        rollout/moe.py; with rows x top_k >= experts a routed decode reads them all too)."""
        if not self.moe.enabled:
            return self.num_dense_params
        h, m = self.hidden_size, self.moe
        every = self.attn_matmul_params + h * m.num_experts + 3 * h * (
            m.num_experts * m.moe_ffn_hidden_size + m.shared_expert_ffn_hidden_size)
        return self.num_layers * every + self.embedding_params

    def all_to_all_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """MoE token dispatch: each token's hidden state sent to its top_k experts and their
        outputs sent back, per layer (one direction each; x (EP-1)/EP of it leaves the rank)."""
        if not self.moe.enabled:
            return 0
        return 2 * self.num_layers * self.moe.top_k * self.hidden_size * bytes_per_value

    @property
    def num_dense_params(self) -> int:
        """N of the "6N" rule: weights in matmuls per token = layer matmuls + the LM head (V x h).

        Biases, norms and the embedding lookup (a gather, not a matmul) are left out. MoE: the
        router and top_k experts (active parameters; `num_params` counts every expert)."""
        return self.num_layers * self.layer_matmul_params + self.embedding_params
