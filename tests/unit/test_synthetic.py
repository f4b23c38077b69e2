"""Synthetic tasks: the `copy` task's length option (data.synthetic_length), checked against the
record text and against the token count of the demo's char tokenizer (the 150-token prompts of
conf/experiment/scaleout_8b.yaml)."""
import pytest

from hybridflow.data import PromptDataset, load_tokenizer, train_sentencepiece
from hybridflow.data.synthetic import make_task, tokenizer_corpus


def test_copy_default_length_unchanged():
    recs = make_task("copy", size=3, seed=0)
    assert all(len(r["reward_model"]["ground_truth"]) == 120 for r in recs)
    assert recs == make_task("copy", size=3, seed=0, length=120)


def test_copy_length_sets_letters_and_answer():
    for r in make_task("copy", size=4, seed=1, length=142):
        letters = r["reward_model"]["ground_truth"]
        assert len(letters) == 142 and set(letters) <= set("abcdefghij")
        assert r["prompt"] == f"copy:{letters}="


def test_copy_150_token_prompts_with_char_tokenizer(tmp_path):
    recs = make_task("copy", size=8, seed=2, length=142)
    model = train_sentencepiece(lines=tokenizer_corpus(recs), model_prefix=tmp_path / "spm",
                                vocab_size=128256, model_type="char")
    tok = load_tokenizer(str(model))
    ds = PromptDataset.from_records(recs, tokenizer=tok, prompt_key="prompt", max_prompt_length=150,
                                    truncation="error", source="synthetic:copy")
    # one token per character plus BOS and the leading word piece
    expected = [len(r["prompt"]) + 2 for r in recs]
    assert [len(ds[i].prompt_ids) for i in range(len(ds))] == expected == [150] * 8


def test_length_refused_by_tasks_without_it():
    with pytest.raises(ValueError, match=r"data.synthetic_length=5: task 'arith'.*copy"):
        make_task("arith", size=2, seed=0, length=5)
    with pytest.raises(ValueError, match="data.synthetic_length=0"):
        make_task("copy", size=2, seed=0, length=0)
