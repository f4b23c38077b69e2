"""trainer.ref_in_gen_tail: what it cannot run with is refused by name; off (null) by default."""

import pytest

from hybridflow.config import load_config
from hybridflow.config_checks import ref_tail_conflicts, validate

GRPO = ["experiment=demo", "algo=grpo", "rollout.compact_finished_rows=true"]


def test_default_is_off_and_a_plain_grpo_run_may_turn_it_on():
    assert load_config(GRPO).trainer.ref_in_gen_tail is None
    cfg = load_config([*GRPO, "trainer.ref_in_gen_tail=true"])
    assert ref_tail_conflicts(cfg) == []
    validate(cfg, world_size=1)


@pytest.mark.parametrize("override,named", [
    ("actor.lora.rank=8", "actor.lora.rank=8"),
    ("trainer.offload_ref=true", "trainer.offload_ref=true"),
    ("algo.dynamic_sampling.enable=true", "algo.dynamic_sampling.enable=true"),
    ("rollout.compact_finished_rows=false", "rollout.compact_finished_rows=false"),
    ("parallel.tensor_parallel_size=2", "parallel.tensor_parallel_size=2"),
    ("algo.use_kl_loss=false", "no reference model"),
])
def test_conflicts_are_named(override, named):
    cfg = load_config([*GRPO, "trainer.ref_in_gen_tail=true", override])
    with pytest.raises(ValueError, match="trainer.ref_in_gen_tail=true cannot run with") as e:
        validate(cfg, world_size=2)
    assert named in str(e.value)
    validate(load_config([*GRPO, "trainer.ref_in_gen_tail=false", override]), world_size=2)


def test_rows_must_be_positive():
    with pytest.raises(ValueError, match="trainer.ref_in_gen_tail_rows"):
        validate(load_config([*GRPO, "trainer.ref_in_gen_tail_rows=0"]), world_size=1)
