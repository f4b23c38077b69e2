r"""GSM8K with the code interpreter beside the single-turn recipe: the results file of the
multi-turn GSM8K run (experiment=gsm8k_tools_qwen_coder_0_5b) and the single-turn run
(experiment=gsm8k_qwen_coder_0_5b), same code, seed and validation set.

Each run folder holds what `gsm8k_h200.sh variant tools|base` leaves (metrics.jsonl,
val_scores.jsonl). Reported: val accuracy per validated step for both (and problem by problem at
the steps both validated: McNemar's exact test), step medians (the first step compiles and
captures; a resumed run's first step is left out as well), the tool run's step split into its
decode loop, appending tool results (prefill of their tokens) and waiting for tools, tool calls
and turns per trajectory per step, and the goal (val accuracy above the single-turn run's at the
last step both validated, at no more than 1.5x its step time).

    python benchmarks/gsm8k_tools_report.py --tools RUNS/tools --single-turn RUNS/base \
        --out benchmarks/results/gsm8k_tools_h200.json --plot benchmarks/results/gsm8k_tools_h200.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gsm8k_variants import paired, summarize  # noqa: E402
from run_record import command, write_json  # noqa: E402

# the tool run's step split: name -> its timing_s/<stage>
SPLIT = {"decode": "multi_turn_decode", "decode_step_wait": "multi_turn_step_wait",
         "decode_host": "multi_turn_host", "tool_prefill": "tool_prefill", "tool_wait": "tool_wait",
         "gen": "gen", "update_actor": "update_actor", "ref": "ref", "step": "step"}
TOOL_PER_STEP = ("tool_calls/mean", "num_turns/mean", "tool_errors/mean")
STEP_RATIO_GOAL = 1.5


def report(tools_dir: str, single_dir: str) -> dict:
    tools = summarize(tools_dir, stages=tuple(SPLIT.values()),
                      per_step=TOOL_PER_STEP + tuple(f"timing_s/{k}" for k in SPLIT.values()))
    single = summarize(single_dir)
    split = {name: round(tools["stages_s"][k], 3) for name, k in SPLIT.items() if k in tools["stages_s"]}
    per_step = lambda k: [[s, round(v, 4)] for s, v in sorted(tools["per_step"].get(k, []))]  # noqa: E731
    tool_val, single_val = dict(tools["val_accuracy"]), dict(single["val_accuracy"])
    common = sorted(set(tool_val) & set(single_val))
    last = common[-1] if common else None
    ratio = tools["step_s"] / single["step_s"] if tools["step_s"] and single["step_s"] else None
    above = last is not None and tool_val[last] > single_val[last]
    return {
        "what": "GRPO on GSM8K, Qwen2.5-Coder-0.5B-Instruct, 64 prompts x 8 per step; with the sandboxed "
                "Python interpreter (code format, up to 4 assistant turns, 1024 response tokens in all) "
                "beside the single-turn recipe; val accuracy by the recipe's reward rule on 319 problems",
        "steps_run": tools["steps"], "single_turn_steps_run": single["steps"],
        "val_accuracy": [[s, round(a, 4)] for s, a in sorted(tool_val.items())],
        "single_turn_val_accuracy": [[s, round(single_val[s], 4)] for s in common],
        "single_turn_val_accuracy_all": [[s, round(a, 4)] for s, a in sorted(single_val.items())],
        "vs_single_turn_problem_by_problem": paired(os.path.join(single_dir, "val_scores.jsonl"),
                                                    os.path.join(tools_dir, "val_scores.jsonl")),
        "step_s": tools["step_s"], "single_turn_step_s": single["step_s"],
        "step_ratio": round(ratio, 2) if ratio else None,
        "step_split_median_s": split,
        "single_turn_stages_median_s": single["stages_s"],
        "tool_calls_per_trajectory": per_step("tool_calls/mean"),
        "turns_per_trajectory": per_step("num_turns/mean"),
        "tool_errors_per_trajectory": per_step("tool_errors/mean"),
        "step_split_per_step": {name: per_step(f"timing_s/{k}") for name, k in SPLIT.items()},
        "peak_gb": tools["peak_gb"], "single_turn_peak_gb": single["peak_gb"],
        "goal": {"last_common_step": last, "val_above_single_turn": above,
                 "step_ratio_at_most": STEP_RATIO_GOAL,
                 "step_ratio_met": ratio is not None and ratio <= STEP_RATIO_GOAL,
                 "steps_wanted": 60, "steps_met": min(tools["steps"], single["steps"]) >= 60},
        "report_command": command(),
    }


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("val_accuracy", "with the Python tool"), ("single_turn_val_accuracy_all", "single turn")):
        xs, ys = zip(*out[key])
        a.plot(xs, ys, marker="o", label=label)
    a.set_xlabel("step"), a.set_ylabel("val accuracy"), a.legend(), a.grid(alpha=0.3)
    split = out["step_split_per_step"]
    for name in ("decode", "tool_prefill", "tool_wait"):
        if split.get(name):
            xs, ys = zip(*split[name])
            b.plot(xs, ys, label=name)
    b.set_xlabel("step"), b.set_ylabel("seconds per step"), b.legend(), b.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", required=True, help="the tool run's folder (metrics.jsonl, val_scores.jsonl)")
    ap.add_argument("--single-turn", required=True, help="the single-turn run's folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="extra top-level fields (machine, commands, notes), JSON values")
    args = ap.parse_args(argv)
    for d in (args.tools, args.single_turn):
        for f in ("metrics.jsonl", "val_scores.jsonl"):
            if not os.path.isfile(os.path.join(d, f)):
                raise SystemExit(f"{d}: no {f} (a run folder of `gsm8k_h200.sh variant` holds it)")
    out = report(args.tools, args.single_turn)
    for kv in args.set:
        key, _, value = kv.partition("=")
        out[key] = json.loads(value)
    write_json(args.out, out)
    if args.plot:
        plot(out, args.plot)
    print(json.dumps({k: out[k] for k in ("val_accuracy", "single_turn_val_accuracy", "step_s",
                                          "single_turn_step_s", "step_split_median_s", "goal")}, indent=1))
    return out


if __name__ == "__main__":
    main()
