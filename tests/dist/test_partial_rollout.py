"""Partial rollouts through the real Trainer on 2 DP ranks (gloo, tiny demo model): every step
trains prompts_per_step complete groups with the carried rows' tokens and log-probs, the metrics
are the same on every rank, a resume drops the groups in flight with a log line (as designed: they
are not checkpointed) and then runs on; with rollout.partial.enable=false the other partial keys
change nothing (the step is today's, bitwise)."""

import pytest

from tests.dist.launcher import run_each

BASE = ["algo=grpo", "trainer.sft_warmup_steps=0", "trainer.tensorboard=false",
        "trainer.progress_bar=false", "data.prompts_per_step=4", "rollout.n=2",
        "rollout.max_new_tokens=8", "rollout.temperature=1.0", "rollout.return_logprobs=true",
        "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4",
        "algo.forward_micro_batch_size_per_gpu=4", "algo.tis_imp_ratio_cap=2.0",
        "reward.fn=tests.dist.test_skip_old_log_prob:digit_count"]
ON = ["rollout.partial.enable=true", "rollout.partial.max_decode_steps=3",
      "rollout.partial.extra_prompts=2", "rollout.partial.max_staleness=2"]


def _runs(out_dir):
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
        sizes = []
        score = trainer.rollout.score
        trainer.rollout.score = lambda items, b: sizes.append(
            (b.batch_size, b.group_ids.tolist(), bool((b.rollout_logprobs != 0).any()))) or score(items, b)
        history = trainer.train()
        return history, sizes

    return {"on": run("on", 2, *ON, "trainer.save_final=true"),
            "resumed": run("on", 3, *ON, "trainer.save_final=false"),
            "off": run("off", 2, "trainer.save_final=false"),
            "off_keys": run("off_keys", 2, "rollout.partial.max_decode_steps=3",
                            "rollout.partial.extra_prompts=2", "trainer.save_final=false")}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("partial_rollout"))
    return run_each(2, {"runs": (_runs, out_dir)})


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
        resumed, _ = r["resumed"]
        assert len(resumed) == 1 and "partial/carried_rows" in resumed[0]
        assert resumed[0]["partial/carried_rows"] == 0  # nothing carried across the resume
    strip = lambda h: [{k: v for k, v in m.items()  # noqa: E731
                        if not k.startswith(("timing", "perf/", "memory"))} for m in h]
    assert strip(r0["on"][0]) == strip(r1["on"][0])  # DP-reduced metrics agree
    # off: the partial keys are not read
    for r in (r0, r1):
        off, off_keys = r["off"][0], r["off_keys"][0]
        assert strip(off) == strip(off_keys)
        assert not any(k.startswith("partial/") for m in off for k in m)
