"""`python -m hybridflow.export`: a checkpoint saved by a tiny model (one spawned rank) becomes a
Hugging Face directory that transformers loads and that gives our model's logits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.dist.launcher import run_ranks

VOCAB, BATCH, SEQ = 61, 2, 8


def _cfg():
    from hybridflow.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, vocab_size=VOCAB, add_qkv_bias=True, rotary_base=1e4)


def _tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def save_tiny_actor(root: str, tokenizer_dir: str):
    """Spawned rank: a bare (ref-style, no DDP) actor at TP=1; save it; return its logits."""
    from hybridflow.checkpoint import save_checkpoint
    from hybridflow.models.build import build_model
    from hybridflow.parallel import groups

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3)
    model = build_model(_cfg(), role="actor", ctx=ctx).eval()
    tokens = _tokens()
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).expand_as(tokens), None)[..., :VOCAB]
    save_checkpoint(root, step=3, models={"actor": [model]}, model_configs={"actor": _cfg()},
                    tokenizer_dir=tokenizer_dir)
    return logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    tok = tmp_path_factory.mktemp("tok")
    (tok / "tokenizer_config.json").write_text("{}")
    logits = run_ranks(save_tiny_actor, 1, root, str(tok))[0]
    return root, logits


def test_export_loads_in_transformers_with_same_logits(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    from hybridflow.export import main

    root, logits = saved
    out = str(tmp_path / "hf")
    assert main([root, out]) == 0  # the root: its latest step
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(_tokens()).logits
    torch.testing.assert_close(hf_logits, logits, rtol=1e-4, atol=1e-5)
    assert main([os.path.join(root, "step_3"), str(tmp_path / "hf2"), "--dtype", "bfloat16"]) == 0
    with open(os.path.join(tmp_path / "hf2", "config.json")) as f:
        assert '"bfloat16"' in f.read()


def test_export_errors(saved, tmp_path, capsys):
    from hybridflow.export import main

    root, _ = saved
    assert main([root, str(tmp_path / "o"), "--step", "7"]) == 2
    assert "step_7" in capsys.readouterr().err
    assert main([root, str(tmp_path / "o"), "--role", "critic"]) == 2
    assert "critic" in capsys.readouterr().err
    missing = str(tmp_path / "nope")
    r = subprocess.run([sys.executable, "-m", "hybridflow.export", missing, str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: no checkpoint at {missing}"  # one line, no traceback
