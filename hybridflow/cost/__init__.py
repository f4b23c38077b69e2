"""Analytic cost model of an RL run: memory per GPU, seconds per stage, GPU-hours, money, and the
parallel layout to use. CLI: `python -m hybridflow.cost --help`; fitting the efficiencies to
measured runs: `python -m hybridflow.cost.calibrate --help`.

Files: gpus (GPU table), shapes (the model: a config.ModelConfig from a name, YAML or config.json),
workload (batch inputs, and the Plan: parallel.layout.Layout + memory options), lengths (response
lengths as a distribution), varlen (a variable-length step row by row), flops, memory,
timing (seconds per stage from `efficiency.Calibration`), search (layout search), estimate (entry points),
report (CostReport), calibrate (fit the efficiencies from measured runs), validate (its per-config
leave-one-out summary)."""
from hybridflow.cost.efficiency import Calibration, load_calibration, shipped_calibration
from hybridflow.cost.estimate import (estimate_cost, estimate_memory, estimate_options,
                                      estimate_step_time)
from hybridflow.cost.gpus import GPUS, get_gpu
from hybridflow.cost.memory import MemoryEstimate
from hybridflow.cost.report import CostReport
from hybridflow.cost.shapes import load_shape
from hybridflow.cost.workload import Plan, Workload

__all__ = ["estimate_cost", "estimate_memory", "estimate_options", "estimate_step_time",
           "CostReport", "Calibration", "MemoryEstimate", "Plan", "Workload", "GPUS", "get_gpu",
           "load_calibration", "load_shape", "shipped_calibration"]
