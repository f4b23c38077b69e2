"""A Hugging Face tokenizer directory rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

GGUF files of BPE models (`tokenizer.ggml.model == "gpt2"`) carry the byte-level token strings, the
merges and the token types; llama.cpp names the pre-tokenizer regex (`tokenizer.ggml.pre`). We rebuild
the equivalent `tokenizers` pipeline: the pre-tokenizer for that name, byte-level BPE, a byte-level
decoder, control tokens (type 3) as special added tokens and user-defined ones (type 4, e.g. Qwen's
`<tool_call>`) as plain added tokens, matched whole as llama.cpp and transformers do. No normalizer:
llama.cpp and transformers' GGUF tokenizer apply none (Qwen2's own tokenizer.json applies NFC, which
leaves NFC text such as GSM8K unchanged). `tokenizer_config.json` gets the chat template and the
BOS/EOS/PAD/UNK strings from their ids (Qwen2.5 instruct files: EOS `<|im_end|>`, BOS and PAD
`<|endoftext|>`), and `add_bos_token` from `tokenizer.ggml.add_bos_token`, so
`hybridflow.data.load_tokenizer(dir)` reads it like a HF one.
The directory is cached in `gguf_file.cache_dir("gguf_tokenizers")` as `<file>-<key>` (key: path,
size, mtime), written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from hybridflow.models.gguf_file import cache_dir as _cache_dir
from hybridflow.models.gguf_file import field, file_key, open_gguf, resolve_gguf_path

# llama.cpp pre-tokenizer names -> HF pre-tokenizers (regexes as in the models' tokenizer.json)
_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_bytes(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {**_GPT2, "use_regex": False}]}


PRE_TOKENIZERS = {
    "gpt2": _GPT2, "default": _GPT2,
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, _GPT2]},
    "llama-bpe": _split_then_bytes(_LLAMA3_RE),
    "qwen2": _split_then_bytes(_QWEN2_RE),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types: special / added but not special


def build_tokenizer_files(reader, path: str) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) contents for the GGUF `reader` of file `path`."""
    kind = field(reader, "tokenizer.ggml.model", path=path, kind=str)
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only gpt2 BPE)")
    pre = field(reader, "tokenizer.ggml.pre", "default", path=path, kind=str)
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; known: "
                         f"{sorted(PRE_TOKENIZERS)}")
    arch = field(reader, "general.architecture", path=path, kind=str)
    tokens = field(reader, "tokenizer.ggml.tokens", path=path, kind=list)
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), path=path, kind=list)
    merges = field(reader, "tokenizer.ggml.merges", path=path, kind=list)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty == _CONTROL}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (_CONTROL, _USER_DEFINED)]
    tok_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }
    config = {"add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False,
                                          path=path)),
              "model_max_length": field(reader, f"{arch}.context_length", 4096, path=path,
                                        kind=int)}
    for key, meta in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        token_id = field(reader, f"tokenizer.ggml.{meta}", -1, path=path, kind=int)
        if token_id == -1:
            continue
        if not 0 <= token_id < len(tokens):
            raise ValueError(f"{path}: metadata key 'tokenizer.ggml.{meta}' is {token_id}, outside "
                             f"the vocabulary of {len(tokens)} tokens")
        config[key] = tokens[token_id]
    if "tokenizer.chat_template" in reader.fields:
        config["chat_template"] = field(reader, "tokenizer.chat_template", path=path, kind=str)
    return tok_json, config


def gguf_tokenizer_dir(path: str, *, cache_dir: str | None = None) -> str:
    """Directory with tokenizer.json + tokenizer_config.json for GGUF file `path` (cached)."""
    path = resolve_gguf_path(path)
    folder = _cache_dir("gguf_tokenizers", cache_dir)
    stem = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(folder, f"{stem}-{file_key(path)}")
    if os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        return out
    tok_json, config = build_tokenizer_files(open_gguf(path), path)
    tmp = tempfile.mkdtemp(dir=folder, prefix=f".{stem}-")
    try:
        for name, data in (("tokenizer.json", tok_json), ("tokenizer_config.json", config)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False)
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(out):  # another process may have won the race: that one is fine
            raise
    return out
