"""The cost model's LoRA calibration records from the update benchmark on one H200.

    python benchmarks/lora_records.py --out benchmarks/results/cost/lora_update_h200.json

From benchmarks/results/train_graphs_packed_h200.json (`bench_lora_update.py --sides ...`, two
device calls): the actor update of Qwen2.5-Coder-0.5B on 512 GSM8K-like rows (prompts of 105
tokens, log-normal responses of mean 300 cut at 1,024: `bench_packed_pass.gsm8k_lengths`'s
defaults), as packed 20,480-token micro-batches, LoRA rank 32 on every linear. Each LoRA record
shares a family with a full-parameter record of the same update, marked `baseline_only`: the
calibration fits the LoRA coefficients to each LoRA record less its baseline's miss
(calibrate.LORA_GROUPS). The eager LoRA update pairs with its own call's eager full update, which
takes out what the call's host speed did to both; the graphed one (call 2) with call 1's graphed
full update (see SIDES). Call 1's LoRA-with-graphs side trained nothing (a bug fixed since) and is
left out. Measured: the median of 3 updates after a warm-up; only timing_s/update_actor (the
benchmark runs no other stage).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.run_record import command, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "benchmarks/results/train_graphs_packed_h200.json"
# (call, side) -> family. The eager sides pair within a call. The graphed sides pair across the
# two calls (call 1's LoRA-with-graphs side is the invalid one, call 2 ran no full-parameter
# graphed side): a graphed update is GPU-bound, so the host speed that moved the eager LoRA
# update by 25% between the calls (1.447 vs 1.803 s; the full one 1.430 vs 1.487) hardly moves it
SIDES = {("call_1", "full"): "call_1", ("call_1", "lora"): "call_1",
         ("call_2", "full"): "call_2", ("call_2", "lora"): "call_2",
         ("call_1", "full+graphs"): "graphs", ("call_2", "lora+graphs"): "graphs"}


def config(d, lengths: list, side: str, budget: int) -> dict:
    """A calibrate.py record config of one benchmark side: `d` the benchmark's length arguments,
    `lengths` its rows' response lengths."""
    kind, _, option = side.partition("+")
    return {"model": "qwen2_5_coder_0_5b", "gpu": "H200", "num_gpus": 1,
            "layout": {"tp": 1, "pp": 1, "dp": 1, "tp_gen": 1, "offload_ref": False,
                       "recompute": False},
            "algorithm": "grpo", "prompts_per_step": d.rows // 8, "samples_per_prompt": 8,
            "prompt_len": d.prompt_len, "max_new_tokens": d.cap,
            "response_lengths": lengths, "ppo_epochs": 1, "mini_batches": 1,
            "micro_batch_tokens": budget, "dynamic_bsz": True, "pack_sequences": True,
            "packed_attention": "varlen", "skip_old_log_prob": True, "decode_kernels": "triton",
            "fused_elementwise": True, "gradient_accumulation_fusion": True, "dtype": "bf16",
            "train_cuda_graphs": option == "graphs", "lora_rank": 32 if kind == "lora" else 0,
            # (that code padded every packed micro-batch to the graphs' shape)
            **({"graph_min_fill": 0.0} if option == "graphs" else {})}


def build(src: dict) -> list[dict]:
    """The records of `src` (SOURCE's JSON)."""
    from benchmarks.bench_packed_pass import add_length_args, gsm8k_lengths

    ap = argparse.ArgumentParser()
    add_length_args(ap)
    d = ap.parse_args([])   # the benchmark's default lengths
    assert (d.rows, d.prompt_len, d.cap) == (src["lengths"]["rows"], src["lengths"]["prompt_len"],
                                             src["lengths"]["response_max"])
    lengths = gsm8k_lengths(d)   # the benchmark's rows, one length each
    recs = []
    for (call, side), family in SIDES.items():
        r = src["update_bench"][call]["results"][side]
        rec = {"name": f"lora-update-bench-{call.replace('_', '')}-{side.replace('+', '-')}",
               "family": f"lora_update_bench_{family}",
               "source_run": f"{SOURCE} update_bench.{call}.results.{side}",
               "config": config(d, lengths, side, src["budget"]),
               "metrics": {"timing_s/update_actor": round(r["update_median_s"], 6)}}
        if side.startswith("full"):
            rec["baseline_only"] = True
        recs.append(rec)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    src = json.load(open(os.path.join(ROOT, SOURCE)))
    write_json(a.out, {"benchmark": "the LoRA update benchmark as cost-model records",
                       "machine": src["machine"], "versions": src["versions"],
                       "command": src["update_bench"]["command"], "derived": command(),
                       "note": f"derived from {SOURCE} (update_bench: two device calls; machine, "
                               "versions and command are that run's)",
                       "records": build(src)})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
