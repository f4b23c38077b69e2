"""Tokenizers from real files: an HF tokenizer.json built with `tokenizers`, a sentencepiece model."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from hybridflow.data import load_tokenizer, train_sentencepiece

LINES = ["Natalia sold clips to 48 of her friends in April.", "How many clips did Natalia sell?",
         "The answer is 72.", "user assistant system hello world"] * 5
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_hf_dir(tmp_path, *, config=None, bos_post_processor=False):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    d = tmp_path / "hf"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_hf_tokenizer_json_with_chat_template(tmp_path):
    d = make_hf_dir(tmp_path, config={"chat_template": CHATML, "eos_token": "<|im_end|>",
                                      "pad_token": {"content": "<|endoftext|>"}, "bos_token": None})
    tok = load_tokenizer(d)
    assert tok.eos_id == 2 and tok.pad_id == 0 and tok.bos_id is None
    assert tok.vocab_size > 4 and tok.has_chat_template
    text = "Natalia sold 48 clips."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == ids  # no BOS configured
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(rendered)
    assert ids[0] == 1 and tok.eos_id in ids  # special tokens in text map to their ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello\nassistant\n"
    assert "<|im_start|>" in tok.decode(ids, skip_special_tokens=False)
    rows = [ids, tok.encode(text), [], ids[:3]]  # decode_batch: decode of each row, in order
    for skip in (True, False):
        assert tok.decode_batch(rows, skip_special_tokens=skip) == [
            tok.decode(r, skip_special_tokens=skip) for r in rows]


def test_hf_pad_falls_back_to_eos_and_bos_from_post_processor(tmp_path):
    d = make_hf_dir(tmp_path, config={"eos_token": "<|endoftext|>", "bos_token": "<s>"}, bos_post_processor=True)
    tok = load_tokenizer(d)
    assert tok.pad_id == tok.eos_id == 0 and tok.bos_id == 3
    assert tok.encode("hello", add_special_tokens=True) == [3] + tok.encode("hello")
    assert not tok.has_chat_template
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "system: be brief\nuser: hi\nassistant: "
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "system: be brief\nuser: hi\n"


def test_chat_template_raise_exception_and_jinja_file(tmp_path):
    d = make_hf_dir(tmp_path, config={"eos_token": "<|im_end|>"})
    (d / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        "{{ bos_token or '' }}{{ eos_token }}{{ messages | tojson }}")
    tok = load_tokenizer(d)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_end|>[{"role": "user", "content": "é"}]'
    with pytest.raises(Exception, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_hf_without_eos_is_an_error(tmp_path):
    d = make_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="eos_token"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="'<nope>' is not in the tokenizer's vocabulary"):
        load_tokenizer(d)


@pytest.mark.parametrize("model_type", ["unigram", "char", "bpe"])
def test_train_sentencepiece_and_load(tmp_path, model_type):
    lines = LINES + ["Question: 12 + 30?\nAnswer: #### 42"]
    path = train_sentencepiece(lines=lines, model_prefix=tmp_path / "sp", vocab_size=80, model_type=model_type,
                               user_defined_symbols=["####"])
    assert path == tmp_path / "sp.model" and path.is_file()
    for source in (path, tmp_path):  # the file, or the directory holding exactly one .model
        tok = load_tokenizer(source)
        assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
        text = "Question: 12 + 30?\nAnswer: #### 42"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=True) == [2] + ids
        assert tok.decode([2] + ids + [3, 0]) == text
        assert tok.decode([2] + ids + [3], skip_special_tokens=False) == "<s>" + text + "</s>"
        rows = [[2] + ids + [3, 0], ids[:4], []]
        assert tok.decode_batch(rows) == [tok.decode(r) for r in rows]
        assert tok.decode_batch(rows, skip_special_tokens=False) == [
            tok.decode(r, skip_special_tokens=False) for r in rows]


def test_sentencepiece_dir_with_chat_template(tmp_path):
    train_sentencepiece(lines=LINES, model_prefix=tmp_path / "tok", vocab_size=60, model_type="char")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
         "add_bos_token": False}))
    tok = load_tokenizer(tmp_path)
    assert tok.has_chat_template and tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_missing_or_unloadable_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor a sentencepiece"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a sentencepiece .model"):
        load_tokenizer(tmp_path / "vocab.txt")
    (tmp_path / "a.model").write_text("x")
    (tmp_path / "b.model").write_text("x")
    with pytest.raises(FileNotFoundError, match="several sentencepiece models"):
        load_tokenizer(tmp_path)


def test_train_sentencepiece_rejects_bad_args(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(lines=LINES, model_prefix=tmp_path / "x", vocab_size=50, model_type="wordpiece")
    with pytest.raises(ValueError, match="lines is empty"):
        train_sentencepiece(lines=[], model_prefix=tmp_path / "x", vocab_size=50)
