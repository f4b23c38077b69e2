"""The GSM8K peer baselines (benchmarks/gsm8k_hf_eval.py, benchmarks/trl_gsm8k.py) end to end on CPU.

A tiny random Qwen2 model is written as a GGUF file (qwen2 architecture, F32 tensors, a byte-level BPE
tokenizer whose EOS is `<|endoftext|>`, as transformers reports for the real file, and a chat template
ending turns with `<|im_end|>`), plus verl-format val/train files. The eval is checked against an
independent greedy loop (one prompt at a time, no padding, full recompute each token); the TRL run
is run through the driver script (benchmarks/gsm8k_peers.sh) and checked for its JSON fields and the
stop tokens TRL was given.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # the peer scripts run end to end (TRL, transformers generate) on CPU

from tests.hf_models import make_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gsm8k_hf_eval as ev  # noqa: E402

SPECIALS = ["<|im_end|>", "<|endoftext|>", "<|im_start|>"]  # <|im_end|> is id 0 (see test_stops_at_im_end)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples?", "7"),
             ("What is 12 plus 30?", "42"),
             ("A box holds 6 eggs. How many eggs in 5 boxes?", "30"),
             ("Sam had 10 coins and lost 2. How many are left?", "8")]
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def record(question: str, answer: str) -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "test"}}


def write_qwen2_gguf(path: Path, hf_dir: str, tok) -> None:
    """A qwen2 GGUF (F32, llama.cpp tensor names, no q/k permutation: convert_hf_to_gguf's Qwen2Model)."""
    from tests.gguf_writer import finish, gguf_writer, hf_tensors

    w = gguf_writer(path, arch="qwen2", hf_dir=hf_dir, tok=tok, pre="qwen2",
                    token_type=lambda t: 3 if t in SPECIALS else 1)
    vocab = tok.get_vocab()
    for add in (w.add_bos_token_id, w.add_eos_token_id, w.add_pad_token_id):
        add(vocab["<|endoftext|>"])
    w.add_chat_template(TEMPLATE)
    for gname, _, a in hf_tensors(hf_dir):
        w.add_tensor(gname, a)
    finish(w)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("gsm8k_peers")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = [f"{q} {INSTRUCTION} #### {a}" for q, a in QUESTIONS] * 4
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_dir = make_checkpoint("qwen2", str(d / "hf"), vocab_size=tok.get_vocab_size(), tie_word_embeddings=False)
    write_qwen2_gguf(d / "tiny.gguf", hf_dir, tok)
    records = [record(q, a) for q, a in QUESTIONS]
    for split in ("train", "val"):
        with open(d / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), d / "val.parquet")
    return d


def reference_greedy(model, tokenizer, prompt: str, *, max_new_tokens: int, stops: set[int]) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in stops:
                break
    return out


def test_records_from_jsonl_and_parquet_agree(files):
    assert ev.load_records(files / "val.jsonl") == ev.load_records(files / "val.parquet")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        ev.load_records(files / "nope.jsonl")


def test_gguf_tokenizer_and_stop_tokens(files):
    tok = ev.load_tokenizer(str(files / "tiny.gguf"))
    vocab = tok.get_vocab()
    assert tok.eos_token == "<|endoftext|>"  # as transformers 5.17 reports for the real file
    assert ev.stop_token_ids(tok) == [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    assert tok.pad_token_id == vocab["<|endoftext|>"] and tok.padding_side == "left"


@pytest.mark.parametrize("explicit_dequantize", [True, False])
def test_gguf_model_is_trainable_and_exact(files, monkeypatch, explicit_dequantize):
    """Loaded with GgufConfig(dequantize=True) the model is plain; without it (older transformers,
    or where the config is missing) transformers marks it quantized and `trainable` rebuilds it."""
    from transformers.trainer_utils import validate_quantization_for_training

    path = str(files / "tiny.gguf")
    if not explicit_dequantize:
        monkeypatch.setattr(ev, "_dequantize_config", lambda: {})
        marked = ev.load_model(path, dtype=torch.float32, device="cpu")
        assert marked.is_quantized
        with pytest.raises(ValueError, match="purely quantized"):
            validate_quantization_for_training(marked)
    model = ev.load_model(path, dtype=torch.float32, device="cpu", trainable=True)
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    validate_quantization_for_training(model)
    hf = ev.load_model(str(files / "hf"), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, hf.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_evaluate_matches_one_prompt_greedy(files):
    path = str(files / "tiny.gguf")
    tok = ev.load_tokenizer(path)
    model = ev.load_model(path, dtype=torch.float32, device="cpu")
    records = ev.load_records(files / "val.jsonl")
    stops = set(ev.stop_token_ids(tok))
    refs = [reference_greedy(model, tok, tok.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                                                tokenize=False), max_new_tokens=6, stops=stops)
            for r in records]
    # batch 3 over 4 prompts of different lengths: left padding inside a batch, and a partial batch
    result = ev.evaluate(model, tok, records, batch_size=3, max_new_tokens=6, rewards=["math_exact", "no_such_rule"])
    texts = [tok.decode(r, skip_special_tokens=True) for r in refs]
    assert [g["response"] for g in result["generations"]] == texts
    assert [g["length"] for g in result["generations"]] == [len(r) for r in refs]
    from hybridflow.reward.rules import math_exact

    expected = sum(math_exact("", t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, records)) / 4
    assert result["accuracy"] == {"math_exact": expected}
    assert result["mean_response_length"] == sum(map(len, refs)) / 4
    assert any("no_such_rule" in n for n in result["notes"])
    assert not model.training


def test_stops_at_im_end(files):
    """With the final norm zeroed every logit is 0 and greedy picks id 0, `<|im_end|>`: the response
    must end there (one token), although the tokenizer's EOS is `<|endoftext|>`."""
    path = str(files / "tiny.gguf")
    tok = ev.load_tokenizer(path)
    model = ev.load_model(path, dtype=torch.float32, device="cpu")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 0
    with torch.no_grad():
        model.model.norm.weight.zero_()
    result = ev.evaluate(model, tok, ev.load_records(files / "val.jsonl")[:2], batch_size=2, max_new_tokens=5,
                         rewards=["math_exact"])
    assert [g["length"] for g in result["generations"]] == [1, 1]
    assert [g["response"] for g in result["generations"]] == ["", ""]


def test_eval_cli_writes_json(files, tmp_path):
    out, gens = tmp_path / "eval.json", tmp_path / "gens.jsonl"
    result = ev.main(["--model", str(files / "tiny.gguf"), "--val", str(files / "val.parquet"), "--out", str(out),
                      "--generations", str(gens), "--max-new-tokens", "4", "--batch-size", "2"])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["n"] == 4 and set(saved["accuracy"]) >= {"math_exact"}
    for key in ("mean_response_length", "seconds", "machine", "versions", "command", "stop_token_ids"):
        assert key in saved, key
    assert len(gens.read_text().splitlines()) == 4


def test_trl_reward_wraps_math_exact():
    pytest.importorskip("trl")
    import trl_gsm8k
    from hybridflow.reward.rules import math_exact

    reward = trl_gsm8k.rule_reward("math_exact")
    texts = ["3 + 4 = 7\n#### 7", "so it is 41", "#### 42", "the answer is \\boxed{30}"]
    truths = ["7", "42", "42", "30"]
    expected = [math_exact("", t, g) for t, g in zip(texts, truths)]
    assert expected == [1.0, 0.0, 1.0, 1.0]
    chat = [[{"role": "assistant", "content": t}] for t in texts]  # TRL's form for chat prompts
    assert reward(completions=chat, ground_truth=truths, prompts=None) == expected
    assert reward(completions=texts, ground_truth=truths) == expected


def test_step_timer_budget_and_json(tmp_path):
    """The callback times steps, validates where asked, saves after each step, stops before a step
    that would end past the budget."""
    from types import SimpleNamespace

    import trl_gsm8k
    from transformers import TrainerControl

    out = tmp_path / "r.json"
    result = {"step_s": [], "step_s_median": None, "first_steps": [], "val_accuracy": [], "val": [], "logs": []}
    calls = []

    def val_fn(model):
        calls.append(model)
        return {"accuracy": {"math_exact": 0.25, "gsm8k_strict": 0.125}, "seconds": 0.0}

    cb = trl_gsm8k.make_callback(result=result, outs=[out], val_at=[0, 2], val_fn=val_fn, budget_s=1e9)
    state, control = SimpleNamespace(global_step=0, max_steps=5), TrainerControl()
    cb.on_train_begin(None, state, control, model="m")
    for step in (1, 2):
        cb.on_step_begin(None, state, control)
        state.global_step = step
        cb.on_step_end(None, state, control, model="m")
        assert json.loads(out.read_text())["steps_done"] == step
    assert result["val_accuracy"] == [[0, 0.25], [2, 0.25]] and calls == ["m", "m"]
    assert result["val_accuracy_strict"] == [[0, 0.125], [2, 0.125]]
    assert result["step_s_median"] == result["step_s"][1] and not control.should_training_stop
    assert result["first_steps"] == [1]
    stop = trl_gsm8k.make_callback(result=result, outs=[out], val_at=[], val_fn=val_fn, budget_s=0.0,
                                   save_on_stop=True)
    stop.on_step_begin(None, state, control)
    state.global_step = 3
    stop.on_step_end(None, state, control, model="m")
    assert control.should_training_stop and control.should_save
    assert json.loads(out.read_text())["stopped_by_budget"]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None,
                    reason="trl and datasets are not installed")
def test_driver_runs_eval_and_two_trl_steps(files, tmp_path):
    """benchmarks/gsm8k_peers.sh as the lead runs it (no wheels to add here: the venv has them)."""
    (tmp_path / "wheels").mkdir()
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               MODEL=str(files / "tiny.gguf"), DATA=str(files), WHEELS=str(tmp_path / "wheels"),
               SITE=str(tmp_path / "site"), OUT=str(tmp_path / "out"), EVAL_BS="2", EVAL_ARGS="--max-new-tokens 8",
               TRL_STEPS="2", TRL_VAL_AT="0,2", TRL_VAL_SIZE="2", TRL_VAL_BS="2",
               TRL_ARGS=f"--prompts-per-step 2 --samples 2 --micro-batch 2 --max-new-tokens 8 "
                        f"--workdir {tmp_path / 'work'}")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gsm8k_peers.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    e = json.loads((tmp_path / "out" / "gsm8k_hf_eval.json").read_text())
    assert e["n"] == 4 and e["max_new_tokens"] == 8 and "math_exact" in e["accuracy"]
    r = json.loads((tmp_path / "out" / "trl_gsm8k.json").read_text())
    assert r["steps_done"] == 2 and len(r["step_s"]) == 2 and r["step_s_median"] == r["step_s"][1]
    assert [s for s, _ in r["val_accuracy"]] == [0, 2]
    assert all(0.0 <= a <= 1.0 for _, a in r["val_accuracy"])
    assert r["config"]["grad_accum"] == 2 and r["config"]["stop_token_ids"] == [0, 1]
    assert sorted(r["config"]["trl_eos_token_ids"]) == [0, 1]  # TRL stops at <|im_end|> and <|endoftext|>
    assert r["config"]["time_budget_s"] > 0 and not r["stopped_by_budget"]
    assert [log["step"] for log in r["logs"] if "reward" in log] == [1, 2]
    for key in ("machine", "versions", "command", "total_s"):
        assert key in r, key


@pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None,
                    reason="trl and datasets are not installed")
def test_trl_resume_across_processes(files, tmp_path):
    """A run the budget stops after step 1 saves a checkpoint; the next --resume run does steps 2-3 and
    continues the same results (val at 0 not repeated, first step of each process out of the median,
    snapshots of both processes listed)."""
    out1, out2, work = tmp_path / "1.json", tmp_path / "2.json", tmp_path / "work"
    base = [sys.executable, str(ROOT / "benchmarks" / "trl_gsm8k.py"), "--model", str(files / "tiny.gguf"),
            "--train", str(files / "train.jsonl"), "--val", str(files / "val.jsonl"), "--prompts-per-step", "2",
            "--samples", "2", "--micro-batch", "4", "--max-new-tokens", "4", "--max-steps", "3",
            "--val-at", "0,2", "--val-size", "2", "--val-batch-size", "2", "--workdir", str(work), "--resume",
            "--save-at", "0,1,3"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for cmd in (base + ["--out", str(out1), "--time-budget-s", "1"], base + ["--out", str(out2)]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    r1, r2 = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert r1["steps_done"] == 1 and r1["stopped_by_budget"] and r1["resumed_from"] is None
    assert (work / "checkpoint-1").is_dir()
    assert r2["resumed_from"].endswith("checkpoint-1") and r2["calls"] == 2 and not r2["stopped_by_budget"]
    assert r2["steps_done"] == 3 and len(r2["step_s"]) == 3 and r2["first_steps"] == [1, 2]
    assert r2["step_s"][0] == r1["step_s"][0] and r2["step_s_median"] == r2["step_s"][2]
    assert [s for s, _ in r2["val_accuracy"]] == [0, 2]
    assert [log["step"] for log in r2["logs"] if "reward" in log] == [1, 2, 3]
    assert json.loads((work / "result.json").read_text()) == r2
    # snapshots of both processes, each saved once (step 0 not again on resume)
    assert r1["snapshots"] == [[s, str(work / "snapshots" / f"step_{s}")] for s in (0, 1)]
    assert r2["snapshots"] == r1["snapshots"] + [[3, str(work / "snapshots" / "step_3")]]
    assert sorted(p.name for p in (work / "snapshots").iterdir()) == ["step_0", "step_1", "step_3"]
