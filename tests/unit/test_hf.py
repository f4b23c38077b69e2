"""HF checkpoint import/export at TP=1 against transformers, on random tiny models saved to tmp dirs."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from hybridflow.config import ModelConfig  # noqa: E402
from hybridflow.models.build import build_model  # noqa: E402
from hybridflow.models.hf import (hf_to_megatron_state_dict, load_hf_weights,  # noqa: E402
                                  megatron_to_hf_state_dict, read_hf_config, save_hf_checkpoint)
from hybridflow.models.hf_config import write_hf_config  # noqa: E402
from tests.hf_models import (KINDS, hf_logits, make_checkpoint,  # noqa: E402
                              single_rank_megatron, write_tokenizer)

IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))  # (B, S)
POS = torch.arange(IDS.shape[1]).expand_as(IDS)


ctx = None  # the 1-rank ParallelContext, set by the fixture below


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    global ctx
    with single_rank_megatron() as ctx:
        yield ctx


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")  # llama is saved sharded to exercise the index file
    return {k: make_checkpoint(k, str(root / k), max_shard_size="40KB" if k == "llama" else None)
            for k in KINDS}


def load(path, role="actor", cfg=None):
    cfg = cfg or read_hf_config(path)
    model = build_model(cfg, role=role, ctx=ctx).eval()
    read = load_hf_weights(model, path, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, role=role)
    return model, cfg, read


def logits(model, cfg):
    with torch.no_grad():
        return model(IDS, POS, attention_mask=None)[..., : cfg.vocab_size]


def all_files(d):
    return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(d, f)).items()}


def test_read_config(ckpts):
    llama, qwen, mistral, qwen3 = (read_hf_config(ckpts[k]) for k in KINDS)
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size) == (2, 64, 128)
    assert (llama.num_attention_heads, llama.num_query_groups, llama.kv_channels) == (4, 2, 16)
    assert llama.vocab_size == 127 and not llama.tie_word_embeddings and not llama.add_qkv_bias
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rotary_base == 500000.0
    assert llama.norm_epsilon == 1e-5 and llama.hf_architecture == "LlamaForCausalLM"
    assert qwen.tie_word_embeddings and qwen.add_qkv_bias and qwen.rotary_base == 1e6
    assert mistral.kv_channels == 32 and mistral.hf_architecture == "MistralForCausalLM"
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias and qwen3.tie_word_embeddings
    assert qwen3.kv_channels == 32 != qwen3.hidden_size // qwen3.num_attention_heads
    assert qwen3.hf_architecture == "Qwen3ForCausalLM" and qwen3.norm_epsilon == 1e-6
    assert not (llama.qk_layernorm or qwen.qk_layernorm or mistral.qk_layernorm)
    assert os.path.isfile(os.path.join(ckpts["llama"], "model.safetensors.index.json"))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(ckpts, kind):
    model, cfg, read = load(ckpts[kind])
    torch.testing.assert_close(logits(model, cfg), hf_logits(ckpts[kind], IDS), atol=1e-4, rtol=1e-4)
    tied = kind in ("qwen2", "qwen3")
    assert ("lm_head.weight" in read) == (not tied)  # tied: the embedding is the head
    if kind == "qwen3":  # q/k norms read whole: (head_dim,) each
        assert read["model.layers.1.self_attn.q_norm.weight"] == 32


def test_untied_qwen3_logits_match_transformers(tmp_path):
    """Qwen3-8B's layout: untied embeddings (the small Qwen3 models tie them)."""
    path = make_checkpoint("qwen3", str(tmp_path / "q3"), tie_word_embeddings=False, seed=3)
    model, cfg, read = load(path)
    assert not cfg.tie_word_embeddings and "lm_head.weight" in read
    torch.testing.assert_close(logits(model, cfg), hf_logits(path, IDS), atol=1e-4, rtol=1e-4)


def test_qwen3_generation_equals_transformers_greedy(ckpts):
    """The in-place generator (decoder.py, torch path) on the converted weights generates what
    transformers' greedy `generate` does, prompt by prompt; prompts of different lengths share a
    left-padded batch here."""
    from transformers import AutoModelForCausalLM

    from hybridflow.config import RolloutConfig
    from hybridflow.rollout import Generator

    path = ckpts["qwen3"]
    cfg = read_hf_config(path)
    params = hf_to_megatron_state_dict(all_files(path), cfg)
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=torch.device("cpu"),
                    dtype=torch.float32, true_vocab_size=cfg.vocab_size)
    prompts = [[3, 17, 99, 5], [42], [7, 8, 9, 10, 11, 12, 13]]
    out = gen.generate(prompts, cfg=RolloutConfig(max_new_tokens=8, temperature=0.0),
                       eos_id=-1, pad_id=0, seed=0)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                               dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert out.response_ids[i].tolist() == want.tolist(), i


def test_state_dict_conversion_is_inverse(ckpts):
    hf = all_files(ckpts["llama"])
    cfg = read_hf_config(ckpts["llama"])
    full = hf_to_megatron_state_dict(hf, cfg, tp=2)
    assert full["embedding.word_embeddings.weight"].shape == (128, 64)  # 127 padded for TP=2
    assert full["output_layer.weight"][127:].abs().sum() == 0
    back = megatron_to_hf_state_dict(full, cfg)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen3"])
def test_round_trip_export(ckpts, tmp_path, kind):
    src = ckpts[kind]
    # qwen2: tokenizer beside the weights, generation_config.json copied from there;
    # mistral: a tokenizer-only dir, generation_config.json derived from its special tokens
    tok_dir = write_tokenizer(src if kind == "qwen2" else str(tmp_path / "tok"), vocab_size=50)
    model, cfg, _ = load(src)
    full = {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
    out = str(tmp_path / "export")
    save_hf_checkpoint(out, megatron_to_hf_state_dict(full, cfg), cfg, tokenizer_dir=tok_dir,
                       max_shard_bytes=30_000)  # forces shards + index
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files
    assert not os.path.exists(out + ".tmp")
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    if kind == "qwen2":
        assert gen == json.load(open(os.path.join(src, "generation_config.json")))
    else:
        assert gen == {"bos_token_id": 1, "eos_token_id": 0}
    exported, original = all_files(out), all_files(src)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    again, cfg2, _ = load(out)
    assert cfg2 == read_hf_config(out) and cfg2.hf_architecture == cfg.hf_architecture
    for k, v in again.state_dict().items():
        if "_extra_state" not in k:
            assert torch.equal(v, full[k]), k
    torch.testing.assert_close(hf_logits(out, IDS), logits(model, cfg), atol=1e-4, rtol=1e-4)
    save_hf_checkpoint(out, full, cfg)  # Megatron names accepted too; replaces the directory
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]


def test_critic_keeps_fresh_head_and_reward_model_loads_score(ckpts, tmp_path):
    critic, cfg, read = load(ckpts["llama"], role="critic")
    assert "lm_head.weight" not in read
    assert critic.output_layer.linear.weight.abs().sum() > 0  # freshly initialised, not loaded
    with pytest.raises(ValueError, match=r"config\.json: role=reward needs a reward model"):
        load(ckpts["llama"], role="reward")
    rm_dir = make_checkpoint("llama", str(tmp_path / "rm"), sequence_classification=True)
    rm, rm_cfg, _ = load(rm_dir, role="reward")
    assert rm.output_layer.linear.bias.item() == 0.0
    with torch.no_grad():
        values = rm(IDS[:1], POS[:1], attention_mask=None)  # (1, S, 1)
    ref = hf_logits(rm_dir, IDS[:1], sequence_classification=True)  # score of the last token
    torch.testing.assert_close(values[0, -1], ref[0], atol=1e-4, rtol=1e-4)


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        read_hf_config(str(tmp_path / "nope"))
    assert str(tmp_path / "nope") in one_line(e)
    cfg = read_hf_config(make_checkpoint("qwen2", str(tmp_path / "q")))
    model = build_model(cfg, role="actor", ctx=ctx)
    with pytest.raises(FileNotFoundError) as e:
        load_hf_weights(model, str(tmp_path / "gone"), cfg, tp_rank=0, tp_size=1, pp_rank=0,
                        pp_size=1)
    assert "gone does not exist" in one_line(e)


def test_missing_tensor_names_file_and_tensor(tmp_path):
    d = make_checkpoint("qwen2", str(tmp_path / "q"))
    f = os.path.join(d, "model.safetensors")
    sd = load_file(f)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        load(d)
    msg = one_line(e)
    assert f in msg and "'model.layers.1.mlp.up_proj.weight' not found" in msg


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    d = make_checkpoint("llama", str(tmp_path / "l"), max_shard_size="40KB")
    c = json.load(open(os.path.join(d, "config.json")))
    c["intermediate_size"] = 96
    json.dump(c, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError) as e:
        load(d)
    msg = one_line(e)
    assert "'model.layers.0.mlp.gate_proj.weight' has shape [128, 64], expected [96, 64]" in msg
    assert ".safetensors" in msg


def test_tokenizer_larger_than_vocab(tmp_path):
    d = make_checkpoint("qwen2", str(tmp_path / "q"))
    write_tokenizer(d, vocab_size=300)
    with pytest.raises(ValueError) as e:
        read_hf_config(d)
    msg = one_line(e)
    assert os.path.join(d, "tokenizer.json") in msg and os.path.join(d, "config.json") in msg
    assert "300 tokens" in msg and "vocab_size=128" in msg


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='yarn' is not supported"),
    ({"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_scaling.rope_type='linear' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                          "rope_theta": 1e4}},
     "low_freq_factor=2.0 is not supported: Megatron's llama3 RoPE scaling fixes it to 1"),
])
def test_unsupported_llama_options(tmp_path, change, match):
    d = str(tmp_path / "c")
    os.makedirs(d)
    c = write_hf_config(ModelConfig())  # a valid Llama config.json to break one field of
    c.update(change)
    json.dump(c, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match=match) as e:
        read_hf_config(d)
    assert os.path.join(d, "config.json") in one_line(e)


def test_sliding_window_rule(tmp_path):
    d = str(tmp_path / "m")
    os.makedirs(d)
    c = write_hf_config(ModelConfig(max_position_embeddings=8192,
                                    hf_architecture="MistralForCausalLM"))
    for window, ok in ((None, True), (8192, True), (4096, False)):
        json.dump({**c, "sliding_window": window}, open(os.path.join(d, "config.json"), "w"))
        if ok:
            assert read_hf_config(d).max_position_embeddings == 8192
        else:
            with pytest.raises(ValueError, match="sliding_window=4096 is not supported"):
                read_hf_config(d)


def test_qwen3_config_rules(tmp_path):
    """Qwen3: attention_bias (which would bias o_proj too) refused; the window counts only when
    use_sliding_window switches it on; qk_layernorm written as Qwen3 and only as Qwen3."""
    d = str(tmp_path / "q3")
    os.makedirs(d)
    c = write_hf_config(ModelConfig(qk_layernorm=True, kv_channels=32, max_position_embeddings=8192))
    assert c["architectures"] == ["Qwen3ForCausalLM"] and c["model_type"] == "qwen3"
    assert c["head_dim"] == 32 and c["attention_bias"] is False
    for change, error in (({}, None), ({"use_sliding_window": False, "sliding_window": 4096}, None),
                          ({"use_sliding_window": True, "sliding_window": 4096},
                           "sliding_window=4096 is not supported"),
                          ({"attention_bias": True}, "attention_bias=True is not supported: "
                           "qwen3's attention_bias also biases o_proj")):
        json.dump({**c, **change}, open(os.path.join(d, "config.json"), "w"))
        if error is None:
            assert read_hf_config(d).qk_layernorm
        else:
            with pytest.raises(ValueError, match=error) as e:
                read_hf_config(d)
            assert os.path.join(d, "config.json") in one_line(e)
    with pytest.raises(ValueError, match="model.qk_layernorm=True cannot be written as "
                                         "Qwen2ForCausalLM: q/k norms exist exactly in Qwen3"):
        write_hf_config(ModelConfig(qk_layernorm=True, add_qkv_bias=True,
                                    hf_architecture="Qwen2ForCausalLM"))
    with pytest.raises(ValueError, match="model.qk_layernorm=False cannot be written as "
                                         "Qwen3ForCausalLM"):
        write_hf_config(ModelConfig(hf_architecture="Qwen3ForCausalLM"))
