"""Tiny GGUF files for tests, written with the `gguf` package as llama.cpp's converter lays them out.

`gguf_writer(path, arch, hf_dir, tok, ...)` opens a GGUFWriter with the shape metadata of the HF
checkpoint's config.json and the BPE tokenizer's vocabulary, types and merges; `hf_tensors(hf_dir)`
yields (gguf name, HF name, array) for its weights (hybridflow.models.gguf's name maps, inverted);
`finish(w)` writes the file. Callers add their own special ids, chat template and tensor encodings.
"""

from __future__ import annotations

import json
import os

import gguf

from hybridflow.models import gguf as hg


def gguf_writer(path, *, arch: str, hf_dir: str, tok, pre: str, token_type,
                rope_base: float | None = None) -> gguf.GGUFWriter:
    """`token_type(token) -> int` (1 normal, 3 control, 4 user-defined); `rope_base` None: the
    config's rope_theta."""
    c = json.load(open(os.path.join(hf_dir, "config.json")))
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    if c.get("head_dim"):  # Qwen3 / Mistral: not hidden / heads
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(rope_base if rope_base is not None else c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([token_type(t) for t in tokens])
    w.add_token_merges([" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]])
    return w


def hf_tensors(hf_dir: str):
    from safetensors.torch import load_file

    rename = {v: k for k, v in hg._GLOBAL.items()}
    layer = {v: k for k, v in hg._LAYER.items()}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name in rename:
            gname = rename[name]
        else:
            _, _, i, *mid, kind = name.split(".")
            gname = f"blk.{i}.{layer['.'.join(mid)]}.{kind}"
        yield gname, name, t.numpy()


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
