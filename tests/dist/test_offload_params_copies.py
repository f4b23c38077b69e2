"""actor.offload_params: the PCIe copies the cost model times (cost/timing.py
offload_params_copies) are the copies the trainer makes, in one real CPU step (PPO with a critic,
its own offloaded reference and an fp8 rollout in place, so the actor's matrices leave in
generation and the whole shard for the ref and critic passes).

Every host <-> device copy of the actor's weights is recorded in order: `ParamOffload.to_host`
copying storages whose host copy is stale, `ParamOffload.to_device` bringing storages back, and
the quantized generator's `fetch` reading the offloaded matrices one at a time (one event per
generation). With the old_log_prob pass skipped the weights stay away from generation to the
actor's update (one return); with it kept they come back after generation (two). Bytes compared
per weight (the CPU runs fp32, the model counts bf16)."""

import pytest

from tests.dist.launcher import run_ranks
from tests.dist.test_offload_params import BASE, PPO

ONE_STEP = ["trainer.total_steps=1", "actor.offload_params=true"]


def _copies(out_dir: str, overrides: list) -> list:
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.offload import ParamOffload
    from hybridflow.parallel import groups
    from hybridflow.rollout.stage import RolloutStage
    from hybridflow.trainer import Trainer

    cfg = load_config([*BASE, *PPO, *ONE_STEP, *overrides, f"trainer.output_dir={out_dir}"])
    validate(cfg, world_size=1)
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    events: list = []  # (direction, elements)

    def to_host(self, keep=frozenset()):
        moved = sum(n for i, (st, n) in enumerate(zip(self._storages, self._nbytes))
                    if not self._away[i] and st.data_ptr() not in keep and not self._valid[i])
        if moved:
            events.append(("d2h", moved // 4))
        return host(self, keep)

    def to_device(self, *, prefetch=False):
        moved = sum(n for n, away in zip(self._nbytes, self._away) if away)
        if moved:
            events.append(("h2d", moved // 4))
        return device(self, prefetch=prefetch)

    def streamed(self):
        params, fetch = stream(self)
        events.append(("h2d", 0))  # this generation's fetches, summed below

        def counted(i, field, t):
            events[-1] = ("h2d", events[-1][1] + t.numel())
            return fetch(i, field, t)
        return params, counted

    host, device, stream = ParamOffload.to_host, ParamOffload.to_device, \
        RolloutStage._streamed_params
    ParamOffload.to_host, ParamOffload.to_device = to_host, to_device
    RolloutStage._streamed_params = streamed
    trainer.train()
    return events


def _predicted(overrides: list) -> list:
    from hybridflow.algo.on_policy import skip_old_log_prob
    from hybridflow.config import load_config
    from hybridflow.cost.timing import offload_params_copies
    from hybridflow.cost.workload import Workload, make_plan

    cfg = load_config([*BASE, *PPO, *ONE_STEP, *overrides])
    skip = skip_old_log_prob(cfg, step=0)[0]
    plan = make_plan({"tp": 1, "tp_gen": 1}, 1, cfg.model)
    work = Workload(algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, prompt_len=8,
                    response_len=4, rollout_quantization="fp8", skip_old_log_prob=skip,
                    offload_params=True)
    stages = ["gen"] + ([] if skip else ["old_log_prob"]) + ["ref", "values", "update_critic",
                                                            "update_actor"]
    return [(d, int(n) // 2) for _, d, n in offload_params_copies(cfg.model, plan, work, stages)]


@pytest.mark.parametrize("overrides", [[], ["algo.skip_redundant_old_log_prob=false"]],
                         ids=["old_log_prob_skipped", "old_log_prob_kept"])
def test_the_model_times_the_copies_the_trainer_makes(tmp_path, overrides):
    (events,) = run_ranks(_copies, 1, str(tmp_path), overrides)
    predicted = _predicted(overrides)
    assert events == predicted
    returns = sum(d == "h2d" for d, _ in events)
    assert returns == (3 if overrides else 2)  # the quantizer's read, (after gen,) the update's
