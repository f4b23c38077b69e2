"""Refusals of hybridflow.config_checks.validate about where a model's weights come from."""

import dataclasses

import pytest

from hybridflow.config import load_config
from hybridflow.config_checks import validate


@pytest.mark.parametrize("role", ["model", "critic_model"])
def test_hf_and_gguf_paths_both_set_are_refused(role):
    cfg = load_config(["experiment=demo"])
    both = dataclasses.replace(cfg.model, hf_path="/models/qwen", gguf_path="/models/qwen.gguf")
    cfg = dataclasses.replace(cfg, **{role: both})
    with pytest.raises(ValueError) as e:
        validate(cfg, world_size=1)
    assert str(e.value) == (f"{role}.hf_path=/models/qwen and {role}.gguf_path=/models/qwen.gguf "
                            f"are both set: the weights come from one of them; set the other to "
                            f"null ({role}.gguf_path=null or {role}.hf_path=null)")
    for source in ({"hf_path": None}, {"gguf_path": None}):  # either one alone is accepted
        validate(dataclasses.replace(cfg, **{role: dataclasses.replace(both, **source)}),
                 world_size=1)


def test_both_paths_are_refused_before_either_file_is_read(capfd):
    from hybridflow.train import main

    code = main(["experiment=demo", "model.hf_path=/nonexistent/qwen",
                 "model.gguf_path=/nonexistent/qwen.gguf", "trainer.output_dir=/nonexistent/out"])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("hybridflow train: error: model.hf_path=/nonexistent/qwen "
                                            "and model.gguf_path=/nonexistent/qwen.gguf are both set")
