"""`python -m hybridflow.export`: a checkpoint saved by a tiny model (one spawned rank) becomes a
Hugging Face directory that transformers loads and that gives our model's logits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.dist.launcher import run_ranks
from tests.tmpfs import fill, mount_tmpfs

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
    assert r.stderr.strip() == f"hybridflow export: error: no checkpoint at {missing}"  # one line


def _tree(path) -> dict:
    """{relative path: bytes} of every file under `path` (what an export must leave untouched)."""
    out = {}
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridflow export: error: "), err
    return lines[0][len("hybridflow export: error: "):]


def test_export_never_writes_over_into_or_inside_its_checkpoint(saved, tmp_path, capsys):
    """The output folder may not be the checkpoint root or step dir, a folder that holds them or a
    folder inside them (real paths: a symlink does not hide the overlap); nothing is touched."""
    from hybridflow.export import main

    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved[0], root)
    os.symlink(root, tmp_path / "link")
    before = _tree(tmp_path / "run")
    step = root / "step_3"
    cases = [(root, root), (root, step), (step, step), (root, step / "actor"), (step, root / "hf"),
             (root, tmp_path / "run"), (step, tmp_path), (tmp_path / "link", tmp_path / "link"),
             (root, tmp_path / "link" / "step_3" / "hf")]
    for src, out in cases:
        assert main([str(src), str(out)]) == 2, (src, out)
        line = _error_line(capsys)
        assert line == (f"{out}: the output folder overlaps the checkpoint {os.path.realpath(root)} "
                        "(it is, holds or lies inside it); expected a folder outside it"), line
    assert _tree(tmp_path / "run") == before
    assert sorted(os.listdir(tmp_path)) == ["link", "run"]  # no temporary folder either
    loose = tmp_path / "loose"  # a step dir outside any root (no `latest`): its siblings are free
    shutil.copytree(step, loose / "step_3")
    assert main([str(loose / "step_3"), str(loose / "hf")]) == 0


def test_export_refuses_to_replace_what_is_not_a_model_folder(saved, tmp_path, capsys):
    from hybridflow.export import main

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    assert main([saved[0], str(tmp_path / "notes")]) == 2
    assert _error_line(capsys) == (f"{tmp_path / 'notes'}: exists and holds files but no "
                                   "config.json; expected a new, empty or model folder (EEXIST)")
    assert main([saved[0], str(tmp_path / "file")]) == 2
    assert _error_line(capsys) == f"{tmp_path / 'file'}: exists and is not a folder (ENOTDIR)"
    assert _tree(tmp_path) == {"notes/todo.txt": b"mine", "file": b"mine"}
    assert main([saved[0], str(tmp_path / "hf")]) == 0  # a model folder is replaced
    assert main([saved[0], str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["file", "hf", "notes"]


def test_export_to_a_read_only_or_full_disk(saved, tmp_path, capsys):
    """Real tmpfs mounts: one line with the path and the errno; no temporary folder left; an earlier
    export in the folder stays as it was."""
    from hybridflow.export import main

    with mount_tmpfs(str(tmp_path / "ro"), read_only=True) as ro:
        assert main([saved[0], f"{ro}/hf"]) == 2
        assert _error_line(capsys) == f"{ro}/hf: Read-only file system (EROFS)"
        assert os.listdir(ro) == []
    with mount_tmpfs(str(tmp_path / "full"), size="1m") as full:
        assert main([saved[0], f"{full}/hf"]) == 0
        capsys.readouterr()
        before = _tree(f"{full}/hf")
        fill(full)
        assert main([saved[0], f"{full}/hf"]) == 2
        assert _error_line(capsys) == f"{full}/hf: No space left on device (ENOSPC)"
        assert sorted(os.listdir(full)) == ["filler", "hf"]
        assert _tree(f"{full}/hf") == before


@pytest.mark.parametrize("victim", ["actor/__0_0.distcp", "actor/.metadata", "actor/common.pt",
                                    "model_config_actor.json"])
def test_export_of_a_truncated_checkpoint_names_the_file(saved, tmp_path, capsys, victim):
    from hybridflow.export import main

    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    path = root / "step_3" / victim
    size = path.stat().st_size
    os.truncate(path, size // 2)
    assert main([str(root), str(tmp_path / "hf")]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"{path}: "), line
    if victim.endswith(".distcp"):
        assert line == (f"{path}: truncated: {size // 2} bytes, its checkpoint index needs "
                        f"{size}; expected the file as the save wrote it"), line
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
