"""trainer.time_budget_s: the step consumer stops before a step would end past the budget."""

from hybridflow import metrics as metrics_mod
from hybridflow.metrics import TimeBudget


def test_stops_before_the_next_step_would_overrun(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: now[0])
    budget = TimeBudget(60.0)
    assert budget.save_on_stop
    now[0] += 20.0  # step 1 ends at t=20 s, took 20 s: another 20 s still fits (40 < 60)
    assert not budget.on_step(1, {"timing_s/step": 20.0})
    now[0] += 25.0  # step 2 (with a 5 s validation) ends at 45 s: the next would end at 70 > 60
    assert budget.on_step(2, {"timing_s/step": 20.0, "timing_s/val": 5.0})


def test_config_rejects_a_negative_budget():
    import pytest

    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    cfg = load_config(["experiment=demo", "trainer.time_budget_s=-1"])
    with pytest.raises(ValueError, match="trainer.time_budget_s=-1"):
        validate(cfg, world_size=1)
