"""Partial rollouts through the real Trainer on 2 DP ranks (gloo, tiny demo model): every step
trains prompts_per_step complete groups with the carried rows' tokens and log-probs, the metrics
are the same on every rank; a checkpoint keeps the groups in flight, so a resumed step is the
uninterrupted run's step (its carried rows continued, every metric bit for bit); with algo=dapo
each dynamic-sampling round takes complete in-flight groups; with rollout.partial.enable=false
the other partial keys change nothing (the step is today's, bitwise)."""

import pytest

from tests.dist.launcher import run_each

BASE = ["trainer.sft_warmup_steps=0", "trainer.tensorboard=false",
        "trainer.progress_bar=false", "data.prompts_per_step=4", "rollout.n=2",
        "rollout.max_new_tokens=8", "rollout.temperature=1.0", "rollout.return_logprobs=true",
        "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4",
        "algo.forward_micro_batch_size_per_gpu=4", "algo.tis_imp_ratio_cap=2.0",
        "reward.fn=tests.dist.test_skip_old_log_prob:digit_count"]
ON = ["rollout.partial.enable=true", "rollout.partial.max_decode_steps=3",
      "rollout.partial.extra_prompts=2", "rollout.partial.max_staleness=2"]


def _runs(out_dir):
    import torch.distributed as dist

    from hybridflow.algo import overlong_penalty
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    def run(name, steps, *extra, algo="algo=grpo"):
        cfg = load_config(["experiment=demo", algo, *BASE, f"trainer.output_dir={out_dir}/{name}",
                           f"trainer.total_steps={steps}", *extra])
        validate(cfg, world_size=dist.get_world_size())
        ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
        trainer = Trainer(cfg, ctx)
        sizes = []
        score = trainer.rollout.score
        trainer.rollout.score = lambda items, b: sizes.append(
            (b.batch_size, b.group_ids.tolist(), bool((b.rollout_logprobs != 0).any()))) or score(items, b)
        advantages = trainer.compute_advantages
        # each step's trained groups' scores before the overlong penalty (what dynamic sampling
        # filtered on; this rank's rows, pooled over DP)
        ob, R = cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens
        penalty = (lambda b: overlong_penalty(b.response_mask.sum(1), max_len=R,
                                              buffer_len=ob.len, penalty_factor=ob.penalty_factor)
                   if ob.enable else 0.0)
        trained = []
        trainer.compute_advantages = lambda b: trained.append(
            ((b.scores - penalty(b)).tolist(), b.group_ids.tolist())) or advantages(b)
        history = trainer.train()
        return (history, sizes, trained) if algo == "algo=dapo" else (history, sizes)

    if out_dir.endswith("@1"):  # one rank resumes the 2-rank checkpoint: both ranks' groups
        import shutil

        out_dir = out_dir[:-2]
        shutil.copytree(f"{out_dir}/on", f"{out_dir}/on_dp1")
        return {"dp1": run("on_dp1", 3, *ON, "trainer.save_final=false")}
    return {"on": run("on", 2, *ON, "trainer.save_final=true"),
            "resumed": run("on", 3, *ON, "trainer.save_final=false"),
            "straight": run("straight", 3, *ON, "trainer.save_final=false"),
            "dapo": run("dapo", 3, *ON, "reward.overlong_buffer.len=4", "trainer.save_final=false",
                        algo="algo=dapo"),
            "off": run("off", 2, "trainer.save_final=false"),
            "off_keys": run("off_keys", 2, "rollout.partial.max_decode_steps=3",
                            "rollout.partial.extra_prompts=2", "trainer.save_final=false"),
            "out_dir": out_dir}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("partial_rollout"))
    return run_each(2, {"runs": (_runs, out_dir)})


def test_resume_at_another_dp_size_continues_every_rank_groups(both, tmp_path_factory):
    """The 2-rank checkpoint resumed on 1 rank: the groups both ranks had in flight continue
    there (the carried rows are the 2-rank run's carried rows of step 3, summed over its ranks)."""
    out_dir = both[0]["runs"]["out_dir"]
    (dp1, _), = [run_each(1, {"runs": (_runs, out_dir + "@1")})[0]["runs"]["dp1"]]
    straight = [r["straight"][0][2] for r in (both[0]["runs"], both[1]["runs"])]
    assert len(dp1) == 1 and dp1[0]["partial/carried_rows"] > 0
    assert dp1[0]["partial/carried_rows"] == straight[0]["partial/carried_rows"]


def test_dynamic_sampling_rounds_of_complete_in_flight_groups(both):
    """algo=dapo with rollout.partial: each dynamic-sampling round takes its prompt batches' worth
    of complete in-flight groups (capped decode, carried rows), the informative ones are kept and
    pooled over DP; a step trains prompts_per_step groups, informative unless the cap was hit."""
    for r in (both[0]["runs"], both[1]["runs"]):
        history, sizes, trained = r["dapo"]
        assert len(history) == 3 and len(trained) == 3
        assert sum(m["partial/carried_rows"] for m in history) > 0
        assert any(m["dynamic_sampling/cap_hit"] == 0 for m in history)
        assert any(m["dynamic_sampling/kept_fraction"] < 1 for m in history)  # some filtered out
        for m, (scores, gids) in zip(history, trained):
            assert m["dynamic_sampling/rounds"] >= 1 and "partial/decode_steps" in m
            assert len(scores) == 4 and len(set(gids)) == 2  # 2 groups of 2 rows per rank
            informative = sum(len({round(s, 4) for s, g in zip(scores, gids) if g == k}) > 1
                              for k in set(gids))
            assert informative == 2 or m["dynamic_sampling/cap_hit"] == 1, (m, scores)
        for b, gids, has_lp in sizes:  # a round scores whole complete groups
            assert b % 2 == 0 and b >= 4 and has_lp


def test_partial_rollouts_through_the_trainer(both):
    r0, r1 = both[0]["runs"], both[1]["runs"]
    for rank, r in enumerate((r0, r1)):
        history, sizes = r["on"]
        assert len(history) == 2
        for b, gids, has_lp in sizes:  # 2 complete groups of 2 rows on each rank, global ids
            assert b == 4 and gids == [2 * rank, 2 * rank, 2 * rank + 1, 2 * rank + 1] and has_lp
        for m in history:
            for k in ("partial/carried_rows", "partial/carried_groups", "partial/staleness_max",
                      "partial/decode_steps"):
                assert k in m
            assert m["partial/decode_steps"] >= 1
            assert "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" in m
        # the first step draws prompts_per_step + extra_prompts groups: 1 per rank stays in flight
        assert history[0]["partial/carried_groups"] == 2
    strip = lambda h: [{k: v for k, v in m.items()  # noqa: E731
                        if not k.startswith(("timing", "perf/", "memory"))} for m in h]
    for r in (r0, r1):  # the resumed step continues the saved groups: the uninterrupted step
        (resumed, rsizes), (straight, ssizes) = r["resumed"], r["straight"]
        assert len(resumed) == 1 and len(straight) == 3
        assert straight[2]["partial/carried_rows"] > 0
        assert strip(resumed) == strip(straight[2:]) and rsizes == ssizes[2:]
    assert strip(r0["on"][0]) == strip(r1["on"][0])  # DP-reduced metrics agree
    # off: the partial keys are not read
    for r in (r0, r1):
        off, off_keys = r["off"][0], r["off_keys"][0]
        assert strip(off) == strip(off_keys)
        assert not any(k.startswith("partial/") for m in off for k in m)
