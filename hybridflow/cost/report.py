"""`CostReport`: what estimate_cost answers, as a dataclass, a dict/JSON and a readable table."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class CostReport:
    model: str
    num_params: int
    gpu: str
    num_gpus: int
    algorithm: str
    workload: dict
    fits: bool                            # False: "won't fit", see overflow and suggestions
    layout: dict                          # recommended (or, when nothing fits, least-overflowing) layout
    reason: str
    memory_gib: dict[str, float]          # per GPU, by component, at the peak phase
    peak_memory_gib: float
    peak_phase: str
    memory_capacity_gib: float            # usable per GPU (memory minus headroom)
    memory_by_phase_gib: dict[str, float]
    gen_batch: int                        # sequences per generation wave per gen replica
    gen_waves: int
    stage_seconds: dict[str, float]       # keys as the trainer's timing_s/<stage>
    time_breakdown: dict[str, dict[str, float]]   # stage -> compute / pp_bubble / tp_comm / ... -> s
    step_seconds: float
    steps: int
    gpu_hours: float
    price_per_gpu_hour: float
    cost: float                           # USD (or whatever price_per_gpu_hour is in)
    tokens_per_step: int
    throughput: float                     # tokens / (step seconds x GPUs), as perf/throughput
    mfu_actor: float
    runners_up: list[dict] = field(default_factory=list)   # layout, step_seconds, peak, fits, reason
    overflow: dict | None = None          # component, phase, gib, peak_gib, capacity_gib
    suggestions: list[str] = field(default_factory=list)
    # rollout.quantization: recommended mode (None: keep the workload's), reason, each mode's
    # predicted step (search.quantization_choice)
    quantization: dict = field(default_factory=dict)
    # rollout.partial: recommended overrides (None: keep the workload's), reason, each decode
    # cap's predicted step (search.partial_choice)
    partial: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        w = self.workload
        lines = [
            f"hybridflow cost estimate: {self.model} ({self.num_params / 1e9:.2f}B params), "
            f"{self.algorithm}, {self.num_gpus} x {self.gpu}",
            f"  batch: {w['prompts_per_step']} prompts x {w['samples_per_prompt']} samples, "
            f"prompt {w['prompt_len']} + response {w['response_len']}"
            + (f" (mean; longest {w['response_len_max']})" if w.get("response_len_max") else "")
            + " tokens, "
            f"{self.tokens_per_step:,} tokens/step",
            "",
            ("layout: " if self.fits else "WON'T FIT; least-overflowing layout: ") + _fmt_layout(self.layout),
            f"  {self.reason}",
        ]
        if self.fits:
            lines.append(f"  trainer overrides (world size {self.num_gpus}): {layout_overrides(self.layout)}")
        lines += [
            "",
            f"memory per GPU at peak ({self.peak_phase}), GiB:",
        ]
        lines += [f"  {k:<16}{v:>9.2f}" for k, v in self.memory_gib.items() if v > 0]
        lines += [f"  {'total':<16}{self.peak_memory_gib:>9.2f}   of {self.memory_capacity_gib:.1f} usable",
                  "  by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in self.memory_by_phase_gib.items()),
                  f"  generation: {self.gen_batch} sequences per wave per replica, {self.gen_waves} wave(s)",
                  "", "seconds per step:"]
        lines += [f"  {k:<16}{v:>9.2f}  {100 * v / self.step_seconds:5.1f}%"
                  for k, v in self.stage_seconds.items()]
        parts: dict[str, float] = {}
        for stage_parts in self.time_breakdown.values():
            for k, v in stage_parts.items():
                parts[k] = parts.get(k, 0.0) + v
        lines += [f"  {'step':<16}{self.step_seconds:>9.2f}",
                  "  where it goes: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                  sorted(parts.items(), key=lambda kv: -kv[1])),
                  f"  throughput {self.throughput:,.0f} tokens/s/GPU, actor MFU {100 * self.mfu_actor:.1f}%",
                  "", f"total: {self.steps} steps, {self.gpu_hours:,.1f} GPU-hours, "
                  f"${self.cost:,.2f} at ${self.price_per_gpu_hour:.2f}/GPU-hour"]
        if self.quantization:
            q = self.quantization
            lines += ["", f"rollout.quantization ({w['rollout_quantization']} given): {q['reason']}"]
            lines += [f"  {m:<5} {o['step_s']:8.2f} s/step, gen {o['gen_s']:.2f} s"
                      + ("" if o["fits"] else ", won't fit")
                      + (" (with actor.offload_params)" if o["offload_params"] else "")
                      for m, o in q["options"].items()]
        if self.partial.get("options"):
            p = self.partial
            lines += ["", f"rollout.partial: {p['reason']}"]
            lines += [f"  max_decode_steps / max_batch_size {c:<9} {o['step_s']:6.2f} s/step, gen "
                      f"{o['gen_s']:.2f} s, peak {o['peak_gib']:.1f} GiB"
                      + ("" if o["fits"] else ", won't fit") for c, o in p["options"].items()]
        if self.overflow:
            o = self.overflow
            lines += ["", f"overflow: {o['component']} ({o['gib']:.1f} GiB) at {o['phase']}; "
                      f"peak {o['peak_gib']:.1f} GiB > {o['capacity_gib']:.1f} GiB usable"]
        if self.suggestions:
            lines += ["", "what would fit:"] + [f"  - {s}" for s in self.suggestions]
        if self.runners_up:
            lines += ["", "runners-up:"]
            lines += [f"  {_fmt_layout(r['layout']):<44} {r['step_seconds']:8.2f} s  "
                      f"{r['peak_memory_gib']:6.1f} GiB  {r['reason']}" for r in self.runners_up]
        if self.notes:
            lines += ["", "assumptions:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def layout_overrides(layout: dict) -> str:
    """The trainer's Hydra overrides for a cost-model layout (DP follows from the world size)."""
    out = [f"parallel.tensor_parallel_size={layout['tp']}",
           f"parallel.pipeline_parallel_size={layout['pp']}",
           f"rollout.tensor_parallel_size={layout['tp_gen']}"]
    if layout.get("ep", 1) > 1:
        out.append(f"parallel.expert_parallel_size={layout['ep']}")
    if layout.get("etp") is not None:
        out.append(f"parallel.expert_tensor_parallel_size={layout['etp']}")
    if layout["tp"] > 1:
        out.append("parallel.sequence_parallel=true")
    if layout["offload_ref"]:
        out.append("trainer.offload_ref=true")
    if layout["recompute"]:
        out.append("parallel.activation_checkpointing=true")
    return " ".join(out)


def _fmt_layout(layout: dict) -> str:
    s = f"TP={layout['tp']} PP={layout['pp']} DP={layout['dp']}"
    s += f" EP={layout['ep']}" if layout.get("ep", 1) > 1 else ""
    s += f" ETP={layout['etp']}" if layout.get("etp") is not None else ""
    s += f" | gen TP={layout['tp_gen']}"
    return s + (" | ref offloaded" if layout["offload_ref"] else "") + \
        (" | recompute (parallel.activation_checkpointing)" if layout["recompute"] else "")
