"""Tiny random-init Hugging Face checkpoints (no hub) for the HF import/export tests.

Four shapes cover the supported options:
- llama:   untied embeddings, GQA (4 heads / 2 KV), llama3 RoPE scaling, odd vocab (127: padded)
- qwen2:   tied embeddings, Q/K/V biases, GQA
- mistral: explicit head_dim (32 != hidden/heads), no sliding window
- qwen3:   per-head q/k RMSNorm, head_dim 32 != hidden/heads, tied embeddings, no Q/K/V bias
and, outside KINDS, qwen3_moe: Qwen3's attention, 8 experts of width 32, top-2 renormalised
(norm_topk_prob), untied embeddings.
Weights are redrawn larger than transformers' init (std 0.2, norms 1 +- 0.1, random biases) so a
mis-mapped tensor shows in the logits.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
KINDS = ("llama", "qwen2", "mistral", "qwen3")


def hf_config(kind: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(**SHAPE, vocab_size=120, head_dim=32, tie_word_embeddings=False,
                             max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[],
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif kind == "llama":
        cfg = LlamaConfig(**SHAPE, vocab_size=127, tie_word_embeddings=False,
                          max_position_embeddings=16384, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                           "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})
    elif kind == "qwen2":
        cfg = Qwen2Config(**SHAPE, vocab_size=128, tie_word_embeddings=True,
                          max_position_embeddings=512, rope_theta=1000000.0)
    elif kind == "qwen3":
        cfg = Qwen3Config(**SHAPE, vocab_size=120, head_dim=32, tie_word_embeddings=True,
                          max_position_embeddings=512,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    else:
        cfg = MistralConfig(**SHAPE, vocab_size=100, head_dim=32, sliding_window=None,
                            max_position_embeddings=512)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def randomize_(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)


def make_checkpoint(kind: str, out_dir: str, *, seed: int = 0, max_shard_size=None,
                    sequence_classification: bool = False, **overrides) -> str:
    """Save a random tiny `kind` model (fp32 safetensors) to `out_dir`; returns `out_dir`."""
    import transformers

    cfg = hf_config(kind, **overrides)
    if sequence_classification:
        cfg.num_labels = 1
        cls = getattr(transformers, type(cfg).__name__.replace("Config", "ForSequenceClassification"))
    else:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    model = cls(cfg).eval()
    randomize_(model, seed)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, safe_serialization=True, **kw)
    return out_dir


def hf_logits(path: str, ids: torch.Tensor, *, sequence_classification: bool = False):
    """Reference output of transformers (eager attention, fp32) for `ids` (B, S)."""
    import transformers

    auto = (transformers.AutoModelForSequenceClassification if sequence_classification
            else transformers.AutoModelForCausalLM)
    model = auto.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def write_tokenizer(out_dir: str, vocab_size: int) -> str:
    """A word-level tokenizer.json with `vocab_size` ids (+ tokenizer_config.json) in `out_dir`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "bos_token": "w1"}, f)
    return out_dir


@contextlib.contextmanager
def single_rank_megatron():
    """A 1-rank gloo world with Megatron's groups (TP=PP=1), torn down with the env it set."""
    from hybridflow.parallel import groups

    saved = dict(os.environ)
    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)
    try:
        yield ctx
    finally:
        groups.destroy()
        os.environ.clear()
        os.environ.update(saved)
