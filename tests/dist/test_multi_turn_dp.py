"""A trainer step on multi-turn rows (tool results inside the response, RolloutBatch.tool_mask) at
DP=2 equals the step at DP=1 (gloo, CPU); tool tokens get no advantage and no loss.

The rollout is test_trainer_dp's deterministic one with tool spans marked: in some rows (a function
of dataset index and sample number alone) the tokens between the first and the last are tool
output. They stay in the forward's context (response_mask) but out of the loss, KL and advantages.
"""

import pytest
import torch

from tests.dist.launcher import run_ranks
from tests.dist.test_trainer_dp import _fake_generate


def _with_tool_spans(generate, n):
    def wrapped(items, **kw):
        batch = generate(items, **kw)
        lengths = batch.response_mask.sum(1)
        tool = torch.zeros_like(batch.response_mask)
        for i in range(batch.batch_size):
            if (int(batch.indices[i]) * 7 + i % n) % 2 == 0 and lengths[i] >= 3:
                tool[i, 1:int(lengths[i]) - 1] = 1
        batch.tool_mask = tool
        return batch

    return wrapped


def one_step(out_dir, extra=()):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    cfg = load_config(["experiment=demo", "algo=grpo", "algo.use_kl_loss=true",
                       "algo.kl_loss_coef=0.1", f"trainer.output_dir={out_dir}",
                       "trainer.sft_warmup_steps=0", "trainer.total_steps=1",
                       "trainer.save_final=false", "trainer.tensorboard=false",
                       "trainer.progress_bar=false", "data.prompts_per_step=8", "rollout.n=4",
                       "rollout.max_new_tokens=6", "algo.ppo_mini_batch_size=32",
                       "algo.micro_batch_size_per_gpu=4", *extra])
    validate(cfg, world_size=torch.distributed.get_world_size())
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    trainer.rollout.generate = _with_tool_spans(_fake_generate(trainer), cfg.rollout.n)
    captured = {}
    compute = trainer.compute_advantages

    def spy(batch):
        batch, m = compute(batch)
        captured.update(advantages=batch.advantages.clone(), tool=batch.tool_mask.clone(),
                        mask=batch.response_mask.clone())
        return batch, m

    trainer.compute_advantages = spy
    metrics = trainer.train_step()
    weights = {name: p.detach().clone() for name, p in trainer.actor.module.named_parameters()}
    return {"metrics": metrics, "weights": weights, **captured}


def test_multi_turn_step_at_dp2_equals_dp1(tmp_path):
    ref = run_ranks(one_step, 1, str(tmp_path / "dp1"))[0]
    assert ref["tool"].sum() > 0  # some rows do carry tool spans
    assert (ref["advantages"][ref["tool"].bool()] == 0).all()
    model = ref["mask"].bool() & ~ref["tool"].bool()
    assert ref["advantages"][model].abs().sum() > 0
    dp2 = run_ranks(one_step, 2, str(tmp_path / "dp2"))
    width = ref["advantages"].shape[1]
    got = torch.cat([torch.nn.functional.pad(d["advantages"], (0, width - d["advantages"].shape[1]))
                     for d in dp2])
    assert torch.allclose(got, ref["advantages"], atol=1e-5)
    keys = [k for k in ref["metrics"] if k.split("/")[0] == "actor" and "lr" not in k]
    assert any("grad_norm" in k for k in keys) and any("loss" in k for k in keys)
    for k in keys:
        for r in range(2):
            assert dp2[r]["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-4, abs=1e-6), k
    for name, w in ref["weights"].items():
        for r in range(2):
            assert torch.allclose(dp2[r]["weights"][name], w, atol=5e-6, rtol=1e-5), name


def real_step(out_dir):
    """One GRPO step through the real multi-turn rollout (the demo's tiny model, the calculator)."""
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    cfg = load_config(["experiment=demo", "algo=grpo", f"trainer.output_dir={out_dir}",
                       "trainer.sft_warmup_steps=0", "trainer.total_steps=1",
                       "trainer.save_final=false", "trainer.tensorboard=false",
                       "trainer.progress_bar=false", "data.prompts_per_step=4", "rollout.n=2",
                       "rollout.max_new_tokens=6", "algo.ppo_mini_batch_size=8",
                       "algo.micro_batch_size_per_gpu=4", "rollout.multi_turn.enable=true",
                       "rollout.multi_turn.tool_config_path=calculator.yaml"])
    validate(cfg, world_size=torch.distributed.get_world_size())
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    metrics = trainer.train_step()
    trainer.rollout.release()
    return metrics


def test_trainer_step_through_the_multi_turn_rollout(tmp_path):
    m = run_ranks(real_step, 1, str(tmp_path))[0]
    assert m["num_turns/mean"] >= 1 and "timing_s/tool_wait" in m and "tool_calls/mean" in m
    assert m["actor/pg_loss"] == m["actor/pg_loss"]  # finite
