"""Per-config validation summary of the leave-one-out check: step time and peak memory, measured vs
predicted by a calibration fitted without that config (`calibrate.predict_vs_measured`).

    python -m hybridflow.cost.calibrate runs/rl_*.json -o calibration.json \\
        --validation cost_validation.json

The JSON is {"validation": {...}} (calibrate.load_records skips it when globbed back in). One entry
per record: the step (`timing_s/step`, the sum of the predicted stages incl. "other") and
peak memory (`perf/max_memory_allocated_gb`), their errors and whether they are within `tolerance_pct`,
plus every stage's leave-one-out row for diagnosis, and the in-sample residual of the full fit.
A config without a measured peak (the variable-length GSM8K records time the step only) counts as
within tolerance on the step alone; one with neither step nor peak (a benchmark of one stage) on
that stage (`judged_on`): a generation benchmark's gen (the quantized-rollout records: a quantized
record's predicted from its call's bf16 measurement, `quantized/gen_from_bf16`: measured bf16 +
predicted quantized - predicted bf16; the bf16 record's as predicted), an update benchmark's
update_actor (the LoRA records).
"""
from __future__ import annotations

STEP_KEY = "timing_s/step"
MEMORY_KEY = "perf/max_memory_allocated_gb"
GEN_KEY = "timing_s/gen"
UPDATE_KEY = "timing_s/update_actor"
QUANT_KEY = "quantized/gen_from_bf16"   # calibrate's row: predicted from the call's bf16 record


def validation(records: list[dict], loo_rows: list[dict], *, command: str,
               in_sample: dict[str, dict[str, float]] | None = None, tolerance_pct: float = 15.0) -> dict:
    """The JSON-ready summary of `loo_rows` (predict_vs_measured's output) for `records`.

    `in_sample`: name -> predictions of the calibration fitted on all records (this one included),
    reported beside as the residual of the fit, which says whether the model's form can describe the
    config at all when leave-one-out cannot (a config alone in exercising a term)."""
    by_name: dict[str, dict[str, dict]] = {}
    for r in loo_rows:
        by_name.setdefault(r["name"], {})[r["metric"]] = r
    configs = []
    for rec in records:
        rows, cfg = by_name.get(rec["name"], {}), rec["config"]
        entry = {"name": rec["name"], "source": rec.get("source"), "machine": rec.get("machine"),
                 "gpu": cfg["gpu"], "num_gpus": cfg["num_gpus"], "model": cfg["model"],
                 "algorithm": cfg.get("algorithm"), "layout": cfg["layout"],
                 **({"family": rec["family"]} if "family" in rec else {})}
        for short, key in (("step_s", STEP_KEY), ("peak_gib", MEMORY_KEY)):
            if key in rows:
                r = rows[key]
                entry |= {f"measured_{short}": r["measured"], f"predicted_{short}": r["predicted"],
                          f"{short}_error_pct": r["error_pct"],
                          f"{short}_within_tolerance": abs(r["error_pct"]) <= tolerance_pct}
                if in_sample and key in in_sample.get(rec["name"], {}):
                    p = in_sample[rec["name"]][key]
                    entry |= {f"in_sample_predicted_{short}": p,
                              f"in_sample_{short}_error_pct": 100 * (p - r["measured"]) / r["measured"]}
        if not ({STEP_KEY, MEMORY_KEY} & set(rows)):  # a one-stage benchmark: judged on it
            key = next((k for k in (QUANT_KEY, GEN_KEY, UPDATE_KEY) if k in rows), None)
            if key is not None:
                r = rows[key]
                entry |= {"judged_on": key, "stage_s_error_pct": r["error_pct"],
                          "stage_s_within_tolerance": abs(r["error_pct"]) <= tolerance_pct}
        entry["stages"] = {k: {"measured": r["measured"], "predicted": r["predicted"],
                               "error_pct": r["error_pct"]}
                           for k, r in rows.items() if k not in (STEP_KEY, MEMORY_KEY)}
        configs.append(entry)
    ok = [c["stage_s_within_tolerance"] if "judged_on" in c else
          c.get("step_s_within_tolerance", False)
          and c.get("peak_gib_within_tolerance", "measured_peak_gib" not in c) for c in configs]
    return {"validation": {
        "method": "leave-one-out: each config predicted by a calibration fitted on the others, "
                  "records of one family (field 'family') left out together (priors: the "
                  "Calibration defaults or --base)",
        "tolerance_pct": tolerance_pct, "command": command, "num_configs": len(configs),
        "num_within_tolerance": sum(ok), "configs": configs}}


def format_validation(summary: dict) -> str:
    summary = summary["validation"]
    lines = [f"{'config':<62} {'step s':>7} {'pred':>7} {'err':>7}   {'peak GiB':>8} {'pred':>7} {'err':>7}"]
    for c in summary["configs"]:
        if "judged_on" in c:   # one stage only: its judged row in the step columns
            r = c["stages"][c["judged_on"]]
            lines.append(f"{c['name'][:62]:<62} {r['measured']:>7.3f} {r['predicted']:>7.3f} "
                         f"{r['error_pct']:>6.1f}%   one stage ({c['judged_on']})")
            continue
        lines.append(f"{c['name'][:62]:<62} {c.get('measured_step_s', float('nan')):>7.3f} "
                     f"{c.get('predicted_step_s', float('nan')):>7.3f} "
                     f"{c.get('step_s_error_pct', float('nan')):>6.1f}%   "
                     f"{c.get('measured_peak_gib', float('nan')):>8.2f} "
                     f"{c.get('predicted_peak_gib', float('nan')):>7.2f} "
                     f"{c.get('peak_gib_error_pct', float('nan')):>6.1f}%")
    lines.append(f"{summary['num_within_tolerance']} of {summary['num_configs']} configs within "
                 f"{summary['tolerance_pct']:g}% on both (step only where no peak was measured; "
                 "the one stage a benchmark timed where neither was)")
    return "\n".join(lines)
