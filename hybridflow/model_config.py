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

from dataclasses import dataclass
from typing import Optional


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
    def layer_matmul_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * f

    @property
    def layer_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) if self.add_qkv_bias else 0
        qk_norms = 2 * self.head_dim if self.qk_layernorm else 0
        return self.layer_matmul_params + bias + 2 * self.hidden_size + qk_norms  # + the norms

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
    def num_dense_params(self) -> int:
        """N of the "6N" rule: weights in matmuls per token = layer matmuls + the LM head (V x h).

        Biases, norms and the embedding lookup (a gather, not a matmul) are left out."""
        return self.num_layers * self.layer_matmul_params + self.embedding_params
