"""Dynamic sampling pools informative groups over DP ranks (2 gloo ranks, no model): every rank runs
the same number of rounds, the pool is rank-major then round-major, each rank takes its slice."""

import pytest

from hybridflow.parallel import groups
from hybridflow.rollout.dynamic_sampling import fill_informative
from tests.dist.launcher import run_each
from tests.unit.test_dapo import N, group_tags, make_round

# rounds[rank][round] = scores of that round's 2 groups (2 samples each)
ROUNDS = [
    [[[0, 0], [1, 0]], [[1, 1], [0, 0]], [[0, 1], [0, 0]]],  # rank 0: kept 11 (r1 g1), 30 (r3 g0)
    [[[1, 1], [1, 1]], [[0, 1], [1, 0]], [[0, 0], [0, 0]]],  # rank 1: kept 120, 121 (r2 g0, g1)
]


def _fill(ctx, max_rounds: int):
    rank = ctx.train.dp
    calls = []

    def next_round(prompts):
        assert prompts == 2  # one batch of num_groups
        calls.append(1)
        tag = 10 * rank + len(calls)
        return make_round(tag, ROUNDS[rank][len(calls) - 1]), {"reward/x/mean": float(len(calls))}

    batch, m = fill_informative(next_round, num_groups=2, group_size=N, max_rounds=max_rounds,
                                dp_group=ctx.dp_group, pad_id=0)
    return {"tags": group_tags(batch), "group_ids": batch.group_ids.tolist(), "metrics": m,
            "calls": len(calls)}


def _worker():
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=0)
    return {max_rounds: _fill(ctx, max_rounds) for max_rounds in (5, 2)}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The pooling rounds and the trainer runs below, one launch of 2 ranks (both tests share it)."""
    out_dir = str(tmp_path_factory.mktemp("dynamic_sampling"))
    return run_each(2, {"pool": (_worker,), "trainer": (_trainer_runs, out_dir)})


def test_pooled_over_dp_and_cap_hit(both):
    results = [rank["pool"] for rank in both]
    r0, r1 = results[0][5], results[1][5]
    assert r0["calls"] == r1["calls"] == 3  # 1 + 0, then 3, then 4 >= 2 x 2 informative groups
    assert r0["tags"] == [11, 30] and r1["tags"] == [120, 121]
    assert r0["group_ids"] == [0, 0, 1, 1] and r1["group_ids"] == [2, 2, 3, 3]
    assert r0["metrics"] == r1["metrics"]
    assert r0["metrics"]["dynamic_sampling/kept_fraction"] == 4 / 12
    assert r0["metrics"]["dynamic_sampling/cap_hit"] == 0
    # cap hit at 2 rounds:
    r0, r1 = results[0][2], results[1][2]
    assert r0["calls"] == r1["calls"] == 2
    # informative 11, 120, 121, then the first spare group in rank-major order: rank 0's r1 g0
    assert r0["tags"] == [11, 120] and r1["tags"] == [121, 10]
    assert r0["metrics"]["dynamic_sampling/cap_hit"] == 1
    assert r0["metrics"]["dynamic_sampling/filler_groups"] == 1


# --- the real Trainer, 2 DP ranks: adaptive rounds and their estimate across a resume ------------

STEPS = 3
BASE = ["algo=dapo", "reward.overlong_buffer.len=2", "trainer.sft_warmup_steps=0",
        "trainer.tensorboard=false", "trainer.progress_bar=false", "data.prompts_per_step=4",
        "rollout.n=4", "rollout.max_new_tokens=6", "algo.ppo_mini_batch_size=16",
        "algo.micro_batch_size_per_gpu=4", "algo.forward_micro_batch_size_per_gpu=8",
        "algo.dynamic_sampling.batches_per_round=3", "algo.dynamic_sampling.adaptive=true",
        "reward.fn=tests.dist.test_skip_old_log_prob:digit_count"]


def _trainer_runs(out_dir):
    import json

    import torch.distributed as dist

    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    def run(name, steps, *extra):
        cfg = load_config(["experiment=demo", *BASE, f"trainer.output_dir={out_dir}/{name}",
                                  f"trainer.total_steps={steps}", *extra])
        validate(cfg, world_size=dist.get_world_size())
        ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
        trainer = Trainer(cfg, ctx)
        asked = []
        some = trainer.sampler.next_prompts  # count the prompts drawn, in batches
        L = trainer.sampler.local_batch_size
        trainer.sampler.next_prompts = lambda count: asked.append(count / L) or some(count)
        history = trainer.train()
        return history, trainer.kept_estimate, sum(asked)

    out = {}
    # the parity reward: some groups score all alike, so rounds find part of what they draw
    conf = ["algo.dynamic_sampling.round_confidence=0.9",
            "reward.fn=tests.dist.test_dynamic_sampling:even_digits"]
    whole = ["algo.dynamic_sampling.round_confidence=null"]  # whole batches (algo=dapo: 0.9)
    for tag, extra in (("", whole), ("conf_", conf)):
        out[tag + "whole"] = run(tag + "whole", STEPS, "trainer.save_final=false", *extra)
        out[tag + "first"] = run(tag + "resumed", 2, "trainer.save_final=true", *extra)
        out[tag + "state"] = json.load(open(f"{out_dir}/{tag}resumed/checkpoints/step_2/"
                                            f"trainer_state.json"))
        out[tag + "second"] = run(tag + "resumed", STEPS, "trainer.save_final=false", *extra)
    return out


def even_digits(prompt, response, ground_truth, extra_info=None) -> float:
    return float(sum(c.isdigit() for c in response) % 2 == 0)


def test_adaptive_rounds_through_the_trainer_and_resume(both):
    results = [rank["trainer"] for rank in both]
    for r in results:
        history, estimate, drawn = r["whole"]
        ds = [{k[len("dynamic_sampling/"):]: v for k, v in m.items() if k.startswith("dynamic_sampling/")}
              for m in history]
        assert len(ds) == STEPS and drawn == sum(d["batches"] for d in ds)
        assert all(d["batches"] >= d["rounds"] and d["cap_hit"] == 0 for d in ds)
        assert ds[0]["batches"] >= 3  # nothing measured yet: the first round draws the cap
        assert estimate == ds[-1]["kept_fraction"] > 0
        # the estimate is saved with the step and restored: the resumed step 3 is the same step
        assert r["state"]["kept_estimate"] == r["first"][0][-1]["dynamic_sampling/kept_fraction"]
        resumed = r["second"][0][-1]
        for key in ("dynamic_sampling/batches", "dynamic_sampling/rounds",
                    "dynamic_sampling/kept_fraction", "dynamic_sampling/score_mean"):
            assert resumed[key] == history[-1][key], key
    # every rank drew the same number of batches each step (sized from DP-summed counts)
    assert len({tuple(m["dynamic_sampling/batches"] for m in r["whole"][0]) for r in results}) == 1


def test_rounds_sized_in_prompts_through_the_trainer_and_resume(both):
    """algo.dynamic_sampling.round_confidence: rounds draw prompts, not whole batches (the sampler
    keeps its place inside a batch, in the checkpoint too); a run resumed at step 2 takes the same
    prompts, rounds and groups at step 3 as the uninterrupted run."""
    results = [rank["trainer"] for rank in both]
    for r in results:
        history, estimate, drawn = r["conf_whole"]
        ds = [{k[len("dynamic_sampling/"):]: v for k, v in m.items()
               if k.startswith("dynamic_sampling/")} for m in history]
        assert len(ds) == STEPS and drawn == pytest.approx(sum(d["batches"] for d in ds))
        assert all(d["cap_hit"] == 0 for d in ds) and ds[0]["batches"] >= 3
        assert any(d["batches"] != int(d["batches"]) for d in ds[1:]), ds  # a part of a batch
        assert r["conf_state"]["sampler"]["dp_size"] == 2
        resumed = r["conf_second"][0][-1]
        for key in ("dynamic_sampling/batches", "dynamic_sampling/rounds",
                    "dynamic_sampling/kept_fraction", "dynamic_sampling/score_mean",
                    "critic/score/mean", "response_length/mean", "actor/pg_loss"):
            assert resumed[key] == history[-1][key], key
    assert len({tuple(m["dynamic_sampling/batches"] for m in r["conf_whole"][0])
                for r in results}) == 1
