"""The base-model fingerprints of adapter-only LoRA checkpoints: a copy of the same files matches,
a changed config, file size or GGUF header does not; a different base is refused with one line
naming the key and both identities, or allowed with a warning line."""

import json
import os
import shutil

import pytest

from hybridflow.checkpoint.base import (GGUF_HEAD_BYTES, check_base, gguf_fingerprint,
                                        hf_fingerprint)


def _hf_dir(path, shard_bytes=1000):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"hidden_size": 64, "num_hidden_layers": 2}, f)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\1" * shard_bytes)
    return str(path)


def test_hf_fingerprint(tmp_path):
    a = _hf_dir(tmp_path / "a")
    copy = shutil.copytree(a, tmp_path / "copy")
    assert hf_fingerprint(a) == hf_fingerprint(copy) and len(hf_fingerprint(a)) == 64
    with open(os.path.join(copy, "model.safetensors"), "ab") as f:  # another size
        f.write(b"\0")
    assert hf_fingerprint(copy) != hf_fingerprint(a)
    other = _hf_dir(tmp_path / "other")
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump({"hidden_size": 64, "num_hidden_layers": 3}, f)
    assert hf_fingerprint(other) != hf_fingerprint(a)


def test_gguf_fingerprint(tmp_path):
    data = bytes(range(256)) * 100
    paths = [str(tmp_path / n) for n in ("a.gguf", "b.gguf", "c.gguf", "d.gguf")]
    for p, blob in zip(paths, [data, data, b"\7" + data[1:], data + b"\0"]):
        with open(p, "wb") as f:
            f.write(blob)
    fps = [gguf_fingerprint(p) for p in paths]
    assert fps[0] == fps[1] and len({fps[0], fps[2], fps[3]}) == 3
    assert GGUF_HEAD_BYTES == 16 << 20


def test_check_base_messages():
    saved = {"source": "hf", "hf_path": "/models/a", "fingerprint": "1" * 64}
    assert check_base(saved, dict(saved, hf_path="/elsewhere/a"), checkpoint="ck/step_2",
                      role="actor") is None  # moved, same content
    other = {"source": "hf", "hf_path": "/models/b", "fingerprint": "2" * 64}
    with pytest.raises(ValueError) as e:
        check_base(saved, other, checkpoint="ck/step_2", role="actor")
    msg = str(e.value)
    assert msg.startswith("model.hf_path:") and "/models/a" in msg and "/models/b" in msg
    assert "1111111111111111" in msg and "2222222222222222" in msg
    assert "trainer.resume_allow_base_change=true" in msg and "\n" not in msg
    line = check_base(saved, other, checkpoint="ck/step_2", role="actor", allow_change=True)
    assert line.startswith("hybridflow: warning: model.hf_path:")
    rnd = {"source": "random", "seed": 1, "fingerprint": "3" * 64}
    with pytest.raises(ValueError, match=r"trainer.seed=1 .*trainer.seed=2"):
        check_base(rnd, dict(rnd, seed=2, fingerprint="4" * 64), checkpoint="c", role="actor")
