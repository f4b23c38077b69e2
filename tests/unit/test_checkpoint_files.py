"""The file-level rules of a checkpoint root, without a model: which step is the newest complete
one when `latest` lags (a crash between publishing `step_N` and rewriting `latest`), what
`recover()` cleans at the start of a run, and which ModelConfig differences refuse a resume."""

from __future__ import annotations

import dataclasses

from hybridflow.checkpoint import latest_step, model_config_diff, recover
from hybridflow.config import ModelConfig


def _root(tmp_path, *, steps, latest=None, leftovers=()):
    for s in steps:
        (tmp_path / f"step_{s}").mkdir()
        (tmp_path / f"step_{s}" / "meta.json").write_text("{}")
    if latest is not None:
        (tmp_path / "latest").write_text(f"{latest}\n")
    for name in leftovers:
        if name.endswith("latest.tmp"):
            (tmp_path / name).write_text("9\n")
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "partial.distcp").write_bytes(b"x")
    return str(tmp_path)


def test_latest_lagging_behind_a_published_step(tmp_path):
    root = _root(tmp_path, steps=[2, 4], latest=2, leftovers=["step_6.tmp", "latest.tmp",
                                                              "step_1.del.tmp"])
    assert latest_step(root) == 4  # the published dir wins over the stale pointer
    assert recover(root) == 4
    assert (tmp_path / "latest").read_text().strip() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_4"]
    assert (tmp_path / "step_2" / "meta.json").exists()  # complete steps are untouched


def test_recover_without_latest_and_on_empty_roots(tmp_path):
    assert recover(str(tmp_path / "missing")) is None
    root = _root(tmp_path, steps=[], leftovers=["step_3.tmp"])
    assert recover(root) is None and list(tmp_path.iterdir()) == []
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_10").mkdir()  # numeric, not lexical, order
    assert recover(root) == 10 and (tmp_path / "latest").read_text().strip() == "10"
    (tmp_path / "latest").write_text("garbage")
    assert recover(root) == 10 and (tmp_path / "latest").read_text().strip() == "10"


def test_model_config_diff_names_every_architecture_key():
    base = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       vocab_size=64)
    assert model_config_diff(base, dataclasses.replace(base)) == {}
    # where it came from, the attention kernel and the RoPE length bound are not the model
    same = dataclasses.replace(base, name="other", hf_path="/x", attention_backend="sdpa",
                               max_position_embeddings=4096, kv_channels=16)  # 16 == 64 // 4
    assert model_config_diff(base, same) == {}
    other = dataclasses.replace(base, vocab_size=96, num_query_groups=4, tie_word_embeddings=True,
                                rotary_base=5e5, rope_scaling={"rope_type": "llama3"},
                                kv_channels=32, add_qkv_bias=True)
    assert model_config_diff(base, other) == {
        "vocab_size": (64, 96), "num_query_groups": (2, 4), "tie_word_embeddings": (False, True),
        "rotary_base": (10000.0, 5e5), "rope_scaling": (None, {"rope_type": "llama3"}),
        "kv_channels": (16, 32), "add_qkv_bias": (False, True)}
