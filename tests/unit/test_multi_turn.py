"""Multi-turn rollouts with tools on CPU: a tiny random model (fp32) forced to emit tool calls. The
incremental cache (tool results appended by a short prefill at each row's next columns, rows at
different turns in one batch) must give the log-probs and K/V of a from-scratch prefill of the whole
conversation; tool tokens are masked out of the loss and carry the rendered results."""

import json

import pytest
import torch

from hybridflow.config import MultiTurnConfig, ModelConfig, RolloutConfig
from hybridflow.data.tokenizer import _compile_template, load_tokenizer
from hybridflow.rollout import Generator, decoder
from hybridflow.rollout.kv_cache import KVCache
from hybridflow.rollout.multi_turn import extend, generate_multi_turn
from hybridflow.rollout.options import DecodeOptions
from hybridflow.tools.runner import ToolRunner
from hybridflow.tools import load_tool_config
from hybridflow.tools.formats import ToolFormat

SPECIALS = ["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>"]
CHATML_TOOLS = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
V = 260
CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=V, add_qkv_bias=True, qk_layernorm=True,
                  max_position_embeddings=512)


def byte_tokenizer(tmp_path):
    """A real byte-level tokenizer.json (256 byte symbols, no merges) + ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "chat_template": CHATML_TOOLS}))
    return load_tokenizer(d)


def params(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.3: torch.randn(*s, generator=g) * std  # noqa: E731
    D, hd, G, H, F = (cfg.hidden_size, cfg.head_dim, cfg.num_query_groups,
                      cfg.num_attention_heads, cfg.ffn_hidden_size)
    p = {"embedding.word_embeddings.weight": r(V + 4, D, std=1.0),
         "decoder.final_layernorm.weight": 1 + r(D, std=0.1), "output_layer.weight": r(V + 4, D)}
    for i in range(cfg.num_layers):
        q = f"decoder.layers.{i}."
        p[q + "input_layernorm.weight"] = 1 + r(D, std=0.1)
        p[q + "pre_mlp_layernorm.weight"] = 1 + r(D, std=0.1)
        p[q + "self_attention.linear_qkv.weight"] = r(G * (H // G + 2) * hd, D)
        p[q + "self_attention.linear_qkv.bias"] = r(G * (H // G + 2) * hd, std=0.1)
        p[q + "self_attention.linear_proj.weight"] = r(D, H * hd)
        p[q + "mlp.linear_fc1.weight"] = r(2 * F, D)
        p[q + "mlp.linear_fc2.weight"] = r(D, F)
        p[q + "self_attention.q_layernorm.weight"] = 1 + r(hd, std=0.3)
        p[q + "self_attention.k_layernorm.weight"] = 1 + r(hd, std=0.3)
    return p


def make_gen():
    return Generator(model_cfg=CFG, params=params(CFG), tp_group=None, device="cpu",
                     dtype=torch.float32, true_vocab_size=V)


def tool_config(tmp_path, *tools):
    entries = {
        "calculator": {"class_name": "calculator", "tool_schema": {"type": "function", "function": {
            "name": "calculator", "description": "arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}},
        "code": {"class_name": "code_interpreter", "config": {"timeout_s": 5, "cpu_s": 3},
                 "tool_schema": {"type": "function", "function": {
                     "name": "code_interpreter", "description": "run python",
                     "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}}}
    path = tmp_path / "tools.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"tools": [entries[t] for t in tools]}))
    return str(path)


def reference_logprobs(gen, prompt, response):
    """log_softmax of a full forward (no cache) over prompt + response, at each response token."""
    seq = torch.tensor([prompt + response])
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 512, dtype=torch.float32, device="cpu")
    lg = decoder.forward(gen.w, seq, torch.arange(seq.shape[1])[None], torch.ones_like(seq).bool(),
                         cos_tab=cos, sin_tab=sin)[0]
    lp = torch.log_softmax(lg[len(prompt) - 1:-1], -1)
    return lp.gather(1, torch.tensor(response)[:, None])[:, 0]


def run(gen, tok, fmt_kind, cfg_path, prompts, forced, *, max_new=320, turns=4,
        prefill_tokens=16384, temperature=1.0, runner_cls=ToolRunner, kv_cache_dtype="auto",
        **hold):
    """`hold`: rollout.multi_turn.append_wait_steps / append_batch_rows (default: the config's),
    append and lookahead (default: held results prefilled, no lookahead; the tests of the decode
    path ask for it)."""
    tools = load_tool_config(cfg_path)
    mt = MultiTurnConfig(enable=True, format=fmt_kind, max_assistant_turns=turns,
                         max_tool_response_length=64, tool_config_path=cfg_path, tool_workers=2,
                         **{"append": "prefill", "lookahead": False, **hold})
    runner = runner_cls(tools, fmt=ToolFormat(fmt_kind, tokenizer=tok, tools=tools),
                        tokenizer=tok, mt=mt)
    try:
        return generate_multi_turn(gen, prompts, cfg=RolloutConfig(
            n=1, max_new_tokens=max_new, temperature=temperature, return_logprobs=True,
            max_batch_size=8, kv_cache_dtype=kv_cache_dtype), runner=runner, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=3,
            options=DecodeOptions(kernels="torch", prefill_tokens=prefill_tokens),
            forced=forced), runner
    finally:
        runner.close()


def call(expr):
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) \
        + "</tool_call>"


def test_extend_equals_full_prefill():
    """Random cache rows, tokens appended at per-row columns (ragged, one row padded): the new
    tokens' logits and K/V equal a prefill of the whole sequence."""
    gen = make_gen()
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 64, dtype=torch.float32, device="cpu")
    seqs = [[5, 9, 3, 7, 1, 2, 8], [4, 4, 6, 10, 11]]
    split = [4, 2]  # prefix prefilled, rest appended
    cache = KVCache(num_layers=2, rows=2, groups=2, length=64, head_dim=CFG.head_dim,
                    dtype=torch.float32, device="cpu")
    kv = torch.zeros(2, 64, dtype=torch.bool)
    for b, (s, k) in enumerate(zip(seqs, split)):  # prefix at columns 10.. (not 0: any column)
        ids = torch.tensor([s[:k]])
        extend(gen.w, ids, torch.arange(k)[None], torch.ones_like(ids).bool(),
               torch.tensor([10]), cache=cache, key_valid=kv, cos_tab=cos, sin_tab=sin,
               rows=torch.tensor([b]))
    S = max(len(s) - k for s, k in zip(seqs, split))
    ids = torch.zeros(2, S, dtype=torch.long)
    valid = torch.zeros(2, S, dtype=torch.bool)
    for b, (s, k) in enumerate(zip(seqs, split)):
        ids[b, :len(s) - k], valid[b, :len(s) - k] = torch.tensor(s[k:]), True
    k_t = torch.tensor(split)[:, None]
    out = extend(gen.w, ids, k_t + torch.arange(S)[None], valid, 10 + k_t[:, 0],
                 cache=cache, key_valid=kv, cos_tab=cos, sin_tab=sin)
    ref_cache = KVCache(num_layers=2, rows=1, groups=2, length=64, head_dim=CFG.head_dim,
                        dtype=torch.float32, device="cpu")
    for b, s in enumerate(seqs):
        t = torch.tensor([s])
        ref = decoder.forward(gen.w, t, torch.arange(len(s))[None], torch.ones_like(t).bool(),
                              cos_tab=cos, sin_tab=sin, cache=ref_cache, last_only=True)
        torch.testing.assert_close(out[b], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.k[:, b, :, 10:10 + len(s)], ref_cache.k[:, 0, :, :len(s)],
                                   rtol=1e-5, atol=1e-5)
        assert kv[b].nonzero()[:, 0].tolist() == list(range(10, 10 + len(s)))


@pytest.mark.parametrize("append,wait_steps", [("prefill", 0), ("prefill", 16), ("decode", 16)],
                         ids=["append_at_once", "hold", "fed_by_decode"])
@pytest.mark.parametrize("prefill_tokens", [16384, 1], ids=["one_extend", "row_by_row"])
def test_hermes_calls_match_a_full_prefill(tmp_path, prefill_tokens, append, wait_steps):
    """prefill_tokens=1: one prefill per prompt, and results that come in together are appended
    by one extend per row. wait_steps: rollout.multi_turn.append_wait_steps (results held and
    appended together; tests/unit/test_multi_turn_append.py times it). append "decode": the
    results' tokens fed one per decode step instead of an extend (the same conversation)."""
    tok = byte_tokenizer(tmp_path)
    gen = make_gen()
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is 6*7?", "Hi", "Two steps please, 2+3 then 5*5", "x")]
    forced = [tok.encode(call("6*7")) + tok.encode("It is 42") + end,
              tok.encode('<tool_call>{"name": calculator}</tool_call>ok') + end,
              tok.encode(call("2+3")) + tok.encode(call("5*5")) + tok.encode("25") + end,
              tok.encode("no tools") + end]
    (batch, metrics), runner = run(gen, tok, "hermes", tool_config(tmp_path, "calculator"),
                                    prompts, forced, prefill_tokens=prefill_tokens,
                                    append_wait_steps=wait_steps, append=append)
    decode = metrics["timing_s/multi_turn_decode"]  # split into the device's steps and the host
    assert metrics["timing_s/multi_turn_step_wait"] > 0 and metrics["timing_s/multi_turn_host"] > 0
    assert abs(metrics["timing_s/multi_turn_step_wait"] + metrics["timing_s/multi_turn_host"]
               - decode) < 1e-9
    tool_tokens = int(batch.tool_mask.sum())
    if append == "decode":  # no extend: every result token went through a decode step
        assert metrics["multi_turn/append_calls"] == 0
        assert metrics["multi_turn/fed_tool_tokens"] == tool_tokens > 0
    else:
        assert metrics["multi_turn/append_calls"] > 0 and metrics["multi_turn/fed_tool_tokens"] == 0
    assert batch.tool_mask is not None and batch.rollout_logprobs is not None
    for b in range(4):
        n = int(batch.response_mask[b].sum())
        assert batch.response_mask[b, :n].all() and not batch.response_mask[b, n:].any()
        resp = batch.response_ids[b, :n].tolist()
        tool = batch.tool_mask[b, :n].bool()
        model = [t for t, m in zip(resp, tool.tolist()) if not m]
        assert model == forced[b]  # the model's tokens are exactly the forced turns
        assert torch.equal(batch.loss_mask()[b, :n].bool(), ~tool)
        text = tok.decode(resp, skip_special_tokens=False)
        ref = reference_logprobs(gen, prompts[b], resp)
        lp = batch.rollout_logprobs[b, :n]
        torch.testing.assert_close(lp[~tool], ref[~tool], rtol=1e-4, atol=1e-4)
        assert (lp[tool] == 0).all()
        if b == 0:
            tool_text = tok.decode([t for t, m in zip(resp, tool.tolist()) if m],
                                   skip_special_tokens=False)
            assert tool_text == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n"
                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        if b == 1:
            assert "Error: the tool call does not parse" in text
        if b == 2:
            assert "\n5\n</tool_response>" in text and "\n25\n</tool_response>" in text
        if b == 3:
            assert not tool.any()
    assert metrics["num_turns/max"] == 3 and metrics["tool_calls/mean"] == 3 / 4
    assert metrics["tool_errors/mean"] == 1 / 4
    assert metrics["num_turns/mean"] == (2 + 2 + 3 + 1) / 4


def test_turn_and_length_limits(tmp_path):
    tok = byte_tokenizer(tmp_path)
    gen = make_gen()
    end = tok.encode("<|im_end|>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "q"}]))
    # three calls, but at most 2 turns: the second call ends the row (its result is not appended)
    forced = [tok.encode(call("1+1") + call("2+2") + call("3+3")) + end]
    (batch, m), _ = run(gen, tok, "hermes", tool_config(tmp_path, "calculator"), [prompt], forced,
                        turns=2)
    text = tok.decode(batch.response_ids[0, :int(batch.response_mask[0].sum())].tolist(),
                      skip_special_tokens=False)
    assert text.endswith(call("2+2")) and m["num_turns/max"] == 2
    # a budget that ends inside the first tool result: cut there, nothing after it
    n_call = len(tok.encode(call("1+1")))
    (batch, _), _ = run(gen, tok, "hermes", tool_config(tmp_path, "calculator"), [prompt], forced,
                        max_new=n_call + 5)
    assert int(batch.response_mask[0].sum()) == n_call + 5
    assert batch.tool_mask[0, n_call:n_call + 5].all()


def test_code_format_runs_the_block(tmp_path):
    tok = byte_tokenizer(tmp_path)
    gen = make_gen()
    end = tok.encode("<|im_end|>")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "compute"}]))
    forced = [tok.encode("Let me run it.\n```python\nprint(6 * 7)\n```") + tok.encode("So 42.") + end,
              tok.encode("```python\nwhile True: pass\n```") + end]
    (batch, m), _ = run(gen, tok, "code", tool_config(tmp_path, "code"), [prompt, prompt], forced)
    texts = [tok.decode(batch.response_ids[b, :int(batch.response_mask[b].sum())].tolist(),
                        skip_special_tokens=False) for b in range(2)]
    assert "```\n```output\n42\n```\nSo 42." in texts[0]
    assert "TimeoutError" in texts[1]  # the trainer's rollout survives the infinite loop
    assert m["tool_timeouts/mean"] == 0.5 and m["tool_errors/mean"] == 0.5
    ref = reference_logprobs(gen, prompt, batch.response_ids[0, :int(batch.response_mask[0].sum())]
                             .tolist())
    tool = batch.tool_mask[0, :len(ref)].bool()
    torch.testing.assert_close(batch.rollout_logprobs[0, :len(ref)][~tool], ref[~tool],
                               rtol=1e-4, atol=1e-4)


def test_chat_prompts_get_the_tools_and_the_system_prompt(tmp_path):
    from hybridflow.data.dataset import PromptDataset

    tok = byte_tokenizer(tmp_path)
    tok_tools = load_tokenizer(tmp_path / "tok")  # a template that lists the tools it is given
    tok_tools._compiled_template = _compile_template(
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}" + CHATML_TOOLS)
    recs = [{"prompt": [{"role": "user", "content": "q"}], "data_source": "x",
             "reward_model": {"ground_truth": "1"}},
            {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}],
             "data_source": "x", "reward_model": {"ground_truth": "1"}}]
    schemas = [t.schema for t in load_tool_config(tool_config(tmp_path, "calculator"))]
    ds = PromptDataset.from_records(recs, tokenizer=tok_tools, max_prompt_length=512,
                                    tools=schemas, system_prompt="Use the tools.")
    assert ds[0].prompt_text == ("[calculator]<|im_start|>system\nUse the tools.<|im_end|>\n"
                                 "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    assert ds[1].prompt_text.startswith("[calculator]<|im_start|>system\nown<|im_end|>")
    plain = PromptDataset.from_records(recs, tokenizer=tok, max_prompt_length=512)
    assert plain[0].prompt_text == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"


def test_fp8_cache_appends_by_extend_as_by_decode(tmp_path):
    """rollout.kv_cache_dtype=fp8: the forced conversation's tool results appended by an extend
    and fed through decode steps give the same log-probs (both write the rounded K/V and attend
    over it, their own new tokens too), the model's tokens are the forced ones, and the log-probs
    differ from the exact cache's (the rounding is there) by a fraction of their spread."""
    tok = byte_tokenizer(tmp_path)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is 6*7?", "Two steps please")]
    forced = [tok.encode(call("6*7")) + tok.encode("It is 42") + end,
              tok.encode(call("2+3")) + tok.encode(call("5*5")) + tok.encode("25") + end]
    cfg_path = tool_config(tmp_path, "calculator")
    gen = make_gen()
    out = {}
    for name, kv, append in (("exact", "auto", "prefill"), ("extend", "fp8", "prefill"),
                             ("decode", "fp8", "decode")):
        (out[name], _), _ = run(gen, tok, "hermes", cfg_path, prompts, forced, append=append,
                                kv_cache_dtype=kv)
        assert gen._cache.fp8 is (kv == "fp8")
    for b in range(2):
        n = int(out["exact"].response_mask[b].sum())
        tool = out["exact"].tool_mask[b, :n].bool()
        for name in ("extend", "decode"):
            assert torch.equal(out[name].response_ids[b, :n], out["exact"].response_ids[b, :n])
        lp = {k: v.rollout_logprobs[b, :n][~tool] for k, v in out.items()}
        torch.testing.assert_close(lp["extend"], lp["decode"], rtol=1e-4, atol=1e-4)
        diff = (lp["extend"] - lp["exact"]).abs()
        assert diff.max() > 0 and diff.mean() < 0.25 * lp["exact"].std()
