"""Prompt datasets in verl's format from real .jsonl / .parquet files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data import PromptDataset, load_tokenizer, train_sentencepiece

CHAT = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    lines = ["What is 2 + 3? Natalia sold clips.", "[user][assistant][system] hello world", "0123456789 #### ."]
    train_sentencepiece(lines=lines * 3, model_prefix=d / "sp", vocab_size=60, model_type="char")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT}))
    return load_tokenizer(d)


def rec(prompt="What is 2 + 3?", **over):
    r = {"prompt": prompt, "data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "5"},
         "extra_info": {"split": "train", "index": 7}}
    r.update(over)
    return r


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_string_and_chat_prompts(tmp_path, tok):
    chat = [{"role": "user", "content": "hello"}]
    path = write_jsonl(tmp_path / "d.jsonl", [rec(), rec(prompt=chat, extra_info=None)])
    ds = PromptDataset.from_file(path, tokenizer=tok, max_prompt_length=64)
    assert len(ds) == 2
    a, b = ds[0], ds[1]
    assert (a.index, a.data_source, a.ground_truth) == (0, "openai/gsm8k", "5")
    assert a.extra_info == {"split": "train", "index": 7}
    assert a.prompt_text == "What is 2 + 3?" and a.prompt_ids == [tok.bos_id] + tok.encode("What is 2 + 3?")
    assert b.prompt_text == "[user]hello[assistant]" and b.prompt_ids == tok.encode(b.prompt_text)  # template owns BOS
    assert b.extra_info is None and [x.index for x in ds] == [0, 1]


def test_parquet_roundtrip(tmp_path, tok):
    records = [rec(prompt=[{"role": "user", "content": "What is 2 + 3?"}]),
               rec(prompt=[{"role": "user", "content": "hello"}], reward_model={"ground_truth": "8"})]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    ds = PromptDataset.from_file(tmp_path / "d.parquet", tokenizer=tok, max_prompt_length=64)
    assert [x.ground_truth for x in ds] == ["5", "8"]
    assert ds[1].prompt_text == "[user]hello[assistant]"


@pytest.mark.parametrize("bad, field", [
    ({"data_source": None}, "data_source"),
    ({"data_source": 3}, "data_source"),
    ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth"),
    ({"reward_model": "5"}, "reward_model"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [{"role": "user"}]}, "prompt"),
    ({"extra_info": [1]}, "extra_info"),
])
def test_jsonl_bad_record_names_line_and_field(tmp_path, tok, bad, field):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rec()) + "\n\n" + json.dumps(rec(**bad)) + "\n")  # bad record on line 3
    with pytest.raises(ValueError) as e:
        PromptDataset.from_file(path, tokenizer=tok, max_prompt_length=64)
    assert str(path) in str(e.value) and "line 3" in str(e.value) and repr(field)[1:-1] in str(e.value)


def test_parquet_bad_row_names_row_and_field(tmp_path, tok):
    pq.write_table(pa.Table.from_pylist([rec(), rec(), {"prompt": "x", "reward_model": {"ground_truth": "1"}}]),
                   tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet: row 2: required field 'data_source' is missing"):
        PromptDataset.from_file(tmp_path / "d.parquet", tokenizer=tok, max_prompt_length=64)


def test_invalid_json_and_unknown_extension(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rec()) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        PromptDataset.from_file(path, tokenizer=tok, max_prompt_length=64)
    with pytest.raises(ValueError, match="unknown extension '.csv'"):
        PromptDataset.from_file(tmp_path / "d.csv", tokenizer=tok, max_prompt_length=64)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        PromptDataset.from_file(tmp_path / "missing.jsonl", tokenizer=tok, max_prompt_length=64)


def test_too_long_prompt_errors_or_truncates(tmp_path, tok):
    long = "What is 2 + 3? " * 4
    path = write_jsonl(tmp_path / "d.jsonl", [rec(prompt="hello"), rec(prompt=long)])
    with pytest.raises(ValueError, match=r"line 2: prompt is \d+ tokens, longer than max_prompt_length=10"):
        PromptDataset.from_file(path, tokenizer=tok, max_prompt_length=10)
    full = [tok.bos_id] + tok.encode(long)
    left = PromptDataset.from_file(path, tokenizer=tok, max_prompt_length=10, truncation="left")[1]
    right = PromptDataset.from_file(path, tokenizer=tok, max_prompt_length=10, truncation="right")[1]
    assert left.prompt_ids == full[-10:] and right.prompt_ids == full[:10] and left.prompt_text == long
    with pytest.raises(ValueError, match="truncation must be one of"):
        PromptDataset.from_file(path, tokenizer=tok, max_prompt_length=10, truncation="middle")


def test_from_records_and_optional_ground_truth(tok):
    ds = PromptDataset.from_records([rec(), rec(prompt="hello")], tokenizer=tok, max_prompt_length=64)
    assert [x.prompt_text for x in ds] == ["What is 2 + 3?", "hello"]
    with pytest.raises(ValueError, match=r"record 0: required field 'reward_model' is missing"):
        PromptDataset.from_records([{"prompt": "hi", "data_source": "rm"}], tokenizer=tok, max_prompt_length=64)
    ds = PromptDataset.from_records([{"prompt": "hi", "data_source": "rm"}], tokenizer=tok, max_prompt_length=64,
                                    require_ground_truth=False)
    assert ds[0].ground_truth is None
    with pytest.raises(ValueError, match="no records"):
        PromptDataset.from_records([], tokenizer=tok, max_prompt_length=64)


# Qwen3's switch: an empty think block after the generation prompt when enable_thinking is false
THINK_CHAT = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and "
              "enable_thinking is false %}<think></think>{% endif %}{% endif %}")


def test_enable_thinking_reaches_the_chat_template(tmp_path):
    """data.enable_thinking: false / true passed to the template, null leaves the template's
    default (here: thinking, no empty block); string prompts never see the template."""
    train_sentencepiece(lines=["[user][assistant] hello <think></think>"] * 3,
                        model_prefix=tmp_path / "sp", vocab_size=40, model_type="char")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": THINK_CHAT}))
    tok = load_tokenizer(tmp_path)
    records = [rec(prompt=[{"role": "user", "content": "hello"}]), rec(prompt="hello")]
    texts = {think: [x.prompt_text for x in PromptDataset.from_records(
        records, tokenizer=tok, max_prompt_length=64, enable_thinking=think)]
        for think in (None, True, False)}
    assert texts[None] == texts[True] == ["[user]hello[assistant]", "hello"]
    assert texts[False] == ["[user]hello[assistant]<think></think>", "hello"]


def test_enable_thinking_needs_a_template_with_the_switch(tok, tmp_path):
    from hybridflow.components import build_tokenizer_and_dataset
    from hybridflow.config import load_config

    cfg = load_config(["experiment=demo", f"data.tokenizer={tok.source}",
                       "data.enable_thinking=false", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"^data.enable_thinking=False but the chat template of "
                                         rf"{tok.source} has no enable_thinking switch"):
        build_tokenizer_and_dataset(cfg)
