"""trainer.gpu_monitor_interval_s through the real trainer (one gloo rank, the short GRPO run):
each step's metrics carry the monitor's perf/gpu_* values, per stage by the stages' own spans,
and the monitor's thread ends with the run. The CPU has no NVML: the monitor reads a stand-in
that reports a lower clock while the actor's update runs."""

import time

import torch

from tests.dist.launcher import run_ranks
from tests.dist.test_free_cache_engine import BASE, STEPS  # the same short GRPO run


def _run(out_dir):
    from hybridflow import gpu_monitor
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    state = {"stage": None}
    made = []

    def for_device(interval_s, device_index, *, asked):  # NVML stood in for
        def read():
            update = state["stage"] == "update_actor"
            return (1600 if update else 1980, 700.0 if update else 300.0, 60, 0x4 if update else 0)

        made.append(gpu_monitor.GpuMonitor(0.002, read))
        return made[-1]

    gpu_monitor.GpuMonitor.for_device = staticmethod(for_device)  # this rank's process only
    cfg = load_config(["experiment=demo", *BASE, f"trainer.output_dir={out_dir}/run"])
    validate(cfg, world_size=torch.distributed.get_world_size())
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    update = trainer.update

    def slow_update(*args, **kw):  # the stage long enough for the stand-in's samples
        state["stage"] = "update_actor"
        try:
            out = update(*args, **kw)
            time.sleep(0.05)
            return out
        finally:
            state["stage"] = None

    trainer.update = slow_update
    history = trainer.train()
    return {"history": [{k: v for k, v in h.items() if k.startswith("perf/gpu")} for h in history],
            "alive": made[0]._thread.is_alive()}


def test_each_step_logs_its_stages_clocks(tmp_path):
    (r,) = run_ranks(_run, 1, str(tmp_path))
    assert len(r["history"]) == STEPS and not r["alive"]
    for h in r["history"]:
        assert h["perf/gpu_sm_mhz/update_actor"] == 1600.0
        assert h["perf/gpu_sm_mhz_min"] == 1600.0 and h["perf/gpu_power_w"] >= 300.0
        assert 0.0 < h["perf/gpu_power_capped"] < 1.0 and h["perf/gpu_thermal_slowdown"] == 0.0
        assert h.get("perf/gpu_sm_mhz/gen", 1980.0) == 1980.0
