"""How many decode steps speculative sampling saves in generation's tail (rollout.speculative), from
real sampled responses.

Samples the GSM8K recipe's first step (Qwen2.5-Coder-0.5B-Instruct from its GGUF, temperature 1,
n samples per prompt, up to --max-new tokens) with the plain decoder, then replays each row through
the tail's drafter: under speculative sampling's coupling, a drafted token is kept exactly when it
equals the token plain sampling drew, so the leading matches of each draft against the row's own
continuation are the kept drafts, in distribution. A batch's plain decode runs until its longest
row ends; with the tail from the first stop poll (every 16 steps) at which at most --max-rows rows
run, those rows advance by (kept + 1) tokens per tail step. Reported per (max_rows, draft_tokens):
decode steps plain and with the tail, the tail's steps both ways and tokens per tail step. The
tail wins when one tail step costs less than (plain tail steps / speculative tail steps) plain
steps; that cost ratio is what a GPU run measures (the GSM8K step with rollout.speculative.enable).

    python benchmarks/spec_tail_study.py --gguf FILE --data .gsm8k --prompts 32 --device cpu \\
        --out benchmarks/results/spec_tail_study_cpu.json
    python benchmarks/spec_tail_study.py --samples rows.json ...   # replay saved rows only

The JSON (written atomically) holds the machine, versions, command and per-row lengths.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402
from hybridflow.rollout.options import DecodeOptions  # noqa: E402
from hybridflow.rollout.speculative import NgramDrafter  # noqa: E402


def sample_rows(a) -> list:
    import torch

    from hybridflow.config import RolloutConfig
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.models.gguf import gguf_tokenizer_dir, load_gguf
    from hybridflow.rollout import Generator

    tok = load_tokenizer(gguf_tokenizer_dir(a.gguf))
    lines = Path(a.data, "train.jsonl").read_text().splitlines()[a.first:a.first + a.prompts]
    prompts = [tok.encode(tok.apply_chat_template(json.loads(x)["prompt"])) for x in lines]
    cfg, params = load_gguf(a.gguf)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=a.device, dtype=dtype,
                    true_vocab_size=tok.vocab_size)
    rc = RolloutConfig(n=a.n, max_new_tokens=a.max_new, temperature=1.0,
                       stop_token_ids=[151643], max_batch_size=len(prompts) * a.n,
                       compact_finished_rows=True)
    t0 = time.perf_counter()
    b = gen.generate(prompts, cfg=rc, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=a.seed)
    print(f"sampled {b.batch_size} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for i in range(b.batch_size):
        p = b.prompt_ids[i][b.prompt_mask[i].bool()].tolist()
        rows.append({"prompt": p, "response": b.response_ids[i, :int(b.response_mask[i].sum())]
                     .tolist()})
    return rows


def tail_steps(prompt: list, response: list, start: int, k: int, ngram: tuple) -> int:
    """Speculative steps that emit response[start:] (each: kept drafts + one token)."""
    d = NgramDrafter([prompt + response[:start]], ngram_max=ngram[0], ngram_min=ngram[1])
    t, steps = start, 0
    while t < len(response):
        draft = d.draft(0, min(k, len(response) - t - 1))
        kept = 0
        while kept < len(draft) and draft[kept] == response[t + kept]:
            kept += 1
        d.append(0, response[t:t + kept + 1])
        t += kept + 1
        steps += 1
    return steps


def study(rows: list, batch: int, max_rows: int, k: int, ngram: tuple) -> dict:
    """Decode steps of batches of `batch` rows (in order), plain and with the tail."""
    plain = spec = tail_plain = tail_spec = tokens = 0
    poll = DecodeOptions().check_every  # the tail starts at a stop poll
    for b0 in range(0, len(rows), batch):
        group = rows[b0:b0 + batch]
        lengths = [len(r["response"]) for r in group]
        longest = max(lengths)
        # decode step s writes output column s; a row of length n is running until step n - 1
        start = next((s for s in range(poll, longest, poll)
                      if sum(n > s + 1 for n in lengths) <= max_rows), None)
        plain += longest - 1
        if start is None:
            spec += longest - 1
            continue
        live = [r for r, n in zip(group, lengths) if n > start + 1]
        steps = [tail_steps(r["prompt"], r["response"], start + 1, k, ngram) for r in live]
        spec += start + max(steps, default=0)
        tail_plain += longest - 1 - start
        tail_spec += max(steps, default=0)
        tokens += sum(len(r["response"]) - start - 1 for r in live)
    return {"max_rows": max_rows, "draft_tokens": k, "decode_steps_plain": plain,
            "decode_steps_spec": spec, "tail_steps_plain": tail_plain, "tail_steps_spec": tail_spec,
            "tail_step_cost_break_even": round(tail_plain / tail_spec, 3) if tail_spec else None,
            "tail_tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="the Qwen2.5-Coder GGUF (sampling)")
    ap.add_argument("--data", default=".gsm8k",
                    help="the output dir of python -m hybridflow.data.prepare gsm8k")
    ap.add_argument("--samples", nargs="*", default=[], help="saved rows (JSON lists) to replay")
    ap.add_argument("--save-samples", help="write the sampled rows here")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--first", type=int, default=0, help="the first training prompt")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=512, help="rows per generate call (the recipe's)")
    ap.add_argument("--max-rows", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--ngram", type=int, nargs=2, default=[3, 1])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = [r for f in a.samples for r in json.loads(Path(f).read_text())]
    if a.gguf:
        new = sample_rows(a)
        if a.save_samples:
            write_json(a.save_samples, new)
        rows += new
    if not rows:
        ap.error("nothing to study: give --gguf (sample) or --samples")
    lengths = sorted(len(r["response"]) for r in rows)
    whole = [tail_steps(r["prompt"], r["response"], 0, 4, tuple(a.ngram)) for r in rows]
    grid = [study(rows, a.batch, m, k, tuple(a.ngram)) for m in a.max_rows for k in a.draft_tokens]
    for g in grid:
        print(json.dumps(g))
    write_json(a.out, {
        "benchmark": "speculative tail: decode steps from sampled GSM8K rows (replayed drafter)",
        "machine": machine(), "versions": versions(), "command": command(),
        "rows": len(rows), "batch": a.batch, "ngram": a.ngram,
        "response_length": {"mean": statistics.mean(lengths), "max": lengths[-1],
                            "p90": lengths[int(0.9 * (len(lengths) - 1))],
                            "at_cap": sum(n >= a.max_new for n in lengths)},
        "tokens_per_step_whole_rows_k4": sum(lengths) / sum(whole),
        "grid": grid, "lengths": lengths})


if __name__ == "__main__":
    main()
