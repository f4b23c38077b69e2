"""critic.lora and actor.offload_params in the config checks: bad values get one line naming the
key and what was expected."""

import pytest

from hybridflow.config import load_config
from hybridflow.config_checks import validate


def _check(overrides, match):
    cfg = load_config(["experiment=demo", *overrides])
    with pytest.raises(ValueError, match=match):
        validate(cfg, world_size=1)


@pytest.mark.parametrize("overrides,match", [
    (["critic.lora.rank=-1"], r"critic\.lora\.rank=-1 must be an integer >= 0"),
    (["critic.lora.rank=4", "critic.lora.alpha=0"], r"critic\.lora\.alpha"),
    (["critic.lora.rank=4", "critic.lora.dropout=1.0"], r"critic\.lora\.dropout=1\.0 must be in"),
    (["critic.lora.rank=4", "critic.lora.target_modules=[qq_proj]"],
     r"critic\.lora\.target_modules=\['qq_proj'\]: expected"),
    (["critic.lora.rank=4", "model.attention_backend=local"],
     r"critic\.lora\.rank=4 needs model\.attention_backend=sdpa"),
    (["critic.lora.rank=4", "algo=grpo"], r"critic\.lora\.rank=4 but algo\.adv_estimator=grpo "
                                          r"trains no critic"),
    (["actor.lora.rank=4", "actor.lora.target_modules=[qq_proj]"],
     r"actor\.lora\.target_modules=\['qq_proj'\]"),
    (["actor.offload_params=true", "parallel.train_cuda_graphs=true"],
     r"actor\.offload_params=true and parallel\.train_cuda_graphs=true"),
])
def test_bad_values_name_the_key(overrides, match):
    _check(overrides, match)


def test_good_values_pass():
    validate(load_config(["experiment=demo", "critic.lora.rank=4", "critic.lora.alpha=8",
                          "critic.lora.target_modules=[q_proj,v_proj]",
                          "actor.offload_params=true"]), world_size=1)
