"""The multi-turn decode loop's host cost per decode step, driven as the GSM8K tool run drives it.

The real Qwen2.5-Coder tokenizer (from its GGUF file), rollout.multi_turn.format=code with the
code_interpreter tool (the sandboxed Python process per call, rollout.multi_turn.tool_workers 16),
append=decode and lookahead (the run's settings), and every row forced (`generate_multi_turn`'s
`forced`) through turns shaped like the model's: a sentence or two, a ```python block that ends the
text (run; its ```output block fed back), sometimes a second block, then a final answer with
`#### N` and <|im_end|>; --long-rows of the rows write on to rollout.max_new_tokens, so the batch
thins out over the steps as the real one does. The reported `host_us_per_step` is
timing_s/multi_turn_host over the decode steps: the loop's own work (bookkeeping, call detection,
polling and feeding results) without the step's device time and tool waits.

--step stub (the CPU default) replaces the decode step by one that emits the forced tokens (EOS
once they run out) and advances the rows' columns: no model compute, so on CPU the number is the
host loop alone. --step model runs the real step (on CPU a tiny random decoder; with --weights gguf
the GGUF's weights, on a GPU the graphed step). --tool canned answers each call from the
snippet's own output computed in-process (no subprocess): the A/B against --tool sandbox is what
the 16 sandbox threads cost the loop. --code DIR imports hybridflow from DIR (e.g. an export of
an older commit) for a before/after on the same rows; `rollout_sha` fingerprints the rollout
(tokens, tool mask, lengths): equal when the loop's output is unchanged.

    python benchmarks/bench_multi_turn_host.py --gguf FILE --device cpu --rows 256 \
        --out /tmp/mt_host_cpu.json                                    # CPU: the host loop alone
    python benchmarks/bench_multi_turn_host.py --gguf FILE --device cuda --step model \
        --weights gguf --rows 512 --out results/mt_host_h200.json      # the real step on a GPU

`--profile K` also prints the K functions of the main thread with the most own time (cProfile).
The JSON (written atomically) holds the machine, versions and command.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import statistics
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402

NOUNS = ["eggs", "apples", "marbles", "books", "cookies", "tickets", "pencils", "stickers"]
NAMES = ["Janet", "Tom", "Maria", "Ken", "Aisha", "Leo"]


def question(rng: random.Random) -> str:
    n, who = rng.choice(NOUNS), rng.choice(NAMES)
    a, b, c = rng.randint(2, 90), rng.randint(2, 30), rng.randint(1, 9)
    return (f"{who} has {a} {n}. Each day {who} buys {b} more and gives away {c}. "
            f"How many {n} does {who} have after a week?")


def snippet(rng: random.Random) -> str:
    """A few lines of arithmetic ending in a print, as the model writes them."""
    names = rng.sample(["total", "per_day", "days", "price", "count", "remaining", "cost",
                        "eggs", "sold", "left"], rng.randint(3, 6))
    lines = [f"# {rng.choice(NOUNS)} {rng.choice(['per day', 'in total', 'left', 'sold'])}"]
    for i, v in enumerate(names):
        if i < 2:
            lines.append(f"{v} = {rng.randint(2, 500)}")
        else:
            op = rng.choice(["+", "-", "*"])
            lines.append(f"{v} = {names[i - 1]} {op} {names[i - 2]}")
    lines.append(f"print({names[-1]})")
    return "\n".join(lines)


def run_snippet(code: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(code, "<snippet>", "exec"), {})  # the benchmark's own arithmetic snippets
    return out.getvalue()


PROSE = ["To solve this, we first find how many there are each day.",
         "Let's break the problem down step by step.",
         "We need the number after seven days, so we multiply and subtract.",
         "First, compute the daily change, then apply it for the whole week.",
         "I'll write a short program to do the arithmetic."]


def trajectory(rng: random.Random, tok, *, long_row: bool, max_new: int) -> list:
    """One row's model tokens: turns separated where the tool's output goes (the loop feeds it)."""
    ids = []
    for k in range(rng.choice([1, 1, 1, 2])):
        text = " ".join(rng.sample(PROSE, rng.randint(1, 3)))
        ids += tok.encode(("" if k == 0 else "\n") + text + "\n\n```python\n" + snippet(rng)
                          + "\n```")
    end = f"\nSo the answer is {rng.randint(1, 999)}.\n#### {rng.randint(1, 999)}"
    if long_row:  # writes on to the budget (the tail of long rows the real run has)
        while len(ids) < max_new + 8:
            ids += tok.encode(end + " " + rng.choice(PROSE))
        return ids
    return ids + tok.encode(end) + [tok.eos_id]


def stub_decode_step(eos_id: int):
    """multi_turn.decode_step's contract without the model: emit the forced token (EOS where
    none), log-prob 0, roll back and advance the rows' columns and positions as the step does."""
    import torch

    from hybridflow.rollout.multi_turn_step import DecodeState as DS

    def make(gen, st, cfg, *, graphed, kv_len=None, opts=None, rollback=False):
        def step():
            c = st.ctrl
            if rollback:
                st.col.sub_(c[DS.ROLLBACK])
                st.pos.sub_(c[DS.ROLLBACK])
            st.out[0].copy_(torch.where(c[DS.FORCED].bool(), c[DS.FORCED_TOKEN], eos_id))
            st.out[1].zero_()
            st.col.add_(c[DS.READY])
            st.pos.add_(c[DS.READY])
        return step

    return make


def tiny_model(vocab: int, positions: int):
    import torch

    from hybridflow.config import ModelConfig
    from benchmarks.bench_multi_turn import random_params

    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      num_query_groups=2, vocab_size=vocab, add_qkv_bias=True,
                      max_position_embeddings=positions)
    return cfg, random_params(cfg, device="cpu", dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, help="the Qwen2.5-Coder GGUF (its tokenizer)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--n", type=int, default=8, help="rollout.n (rows per prompt)")
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--long-rows", type=float, default=0.1,
                    help="the fraction of rows that write to the budget")
    ap.add_argument("--tool", default="sandbox", choices=["sandbox", "canned"])
    ap.add_argument("--tool-workers", type=int, default=16)
    ap.add_argument("--no-lookahead", action="store_true")
    ap.add_argument("--step", default=None, choices=["stub", "model"],
                    help="default: stub on CPU, model on a GPU")
    ap.add_argument("--weights", default="tiny", choices=["tiny", "gguf"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on a GPU")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--code", default=None, help="import hybridflow from this directory")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.code:
        sys.path.insert(0, str(Path(a.code).resolve()))
    import numpy as np
    import torch

    import hybridflow
    from hybridflow.config import MultiTurnConfig, RolloutConfig
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.models.gguf import gguf_tokenizer_dir, load_gguf
    from hybridflow.rollout import Generator, multi_turn
    from hybridflow.tools import load_tool_config
    from hybridflow.tools.base import tool_from_function
    from hybridflow.tools.formats import ToolFormat
    from hybridflow.tools.runner import ToolRunner

    step_kind = a.step or ("stub" if a.device == "cpu" else "model")
    dtype = getattr(torch, a.dtype or ("float32" if a.device == "cpu" else "bfloat16"))
    tok = load_tokenizer(gguf_tokenizer_dir(a.gguf))
    rng = random.Random(a.seed)
    n_prompts = -(-a.rows // a.n)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": question(rng)}]))
               for _ in range(n_prompts)]
    rows = n_prompts * a.n
    forced = [trajectory(rng, tok, long_row=rng.random() < a.long_rows, max_new=a.max_new)
              for _ in range(rows)]
    if a.weights == "gguf":
        cfg, params = load_gguf(a.gguf)
    else:
        cfg, params = tiny_model(151936, max(len(p) for p in prompts) + a.max_new + 64)
    tools = load_tool_config("code_interpreter.yaml")
    if a.tool == "canned":
        tools = [tool_from_function(lambda code: run_snippet(code), name=tools[0].name,
                                    schema=tools[0].schema)]
    mt = MultiTurnConfig(enable=True, tool_config_path="code_interpreter.yaml", format="code",
                         max_assistant_turns=4, tool_workers=a.tool_workers, append="decode",
                         lookahead=not a.no_lookahead)
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=a.device, dtype=dtype,
                    true_vocab_size=tok.vocab_size)
    rc = RolloutConfig(n=a.n, max_new_tokens=a.max_new, temperature=1.0,
                       stop_token_ids=[151643], max_batch_size=rows, return_logprobs=True)
    if step_kind == "stub":
        multi_turn.decode_step = stub_decode_step(tok.eos_id)

    def run(seed):
        runner = ToolRunner(tools, fmt=ToolFormat("code", tokenizer=tok, tools=tools),
                            tokenizer=tok, mt=mt)
        try:
            return generate_multi_turn(seed, runner)
        finally:
            runner.close()

    def generate_multi_turn(seed, runner):
        return multi_turn.generate_multi_turn(gen, prompts, cfg=rc, runner=runner,
                                              eos_id=tok.eos_id, pad_id=tok.pad_id, seed=seed,
                                              forced=forced)

    # the model tokens whose text holds a backtick: the rows whose turn text the loop decodes
    close = ToolRunner(tools, fmt=ToolFormat("code", tokenizer=tok, tools=tools), tokenizer=tok,
                       mt=mt).close_tokens(gen.w.dims.true_vocab)
    may_close = sum(int(close[f].sum()) for f in map(np.array, forced)) / sum(map(len, forced))
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    run(0)  # warm-up: close_tokens, graph capture, allocator
    sync()
    reps, batch = [], None
    for r in range(a.reps):
        prof = None
        if a.profile and r == a.reps - 1:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        batch, m = run(1)
        sync()
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            import pstats

            pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
        steps = m["multi_turn/decode_steps"]
        reps.append({"wall_s": wall, "decode_steps": steps,
                     "host_us_per_step": m["timing_s/multi_turn_host"] / steps * 1e6,
                     "step_wait_us_per_step": m["timing_s/multi_turn_step_wait"] / steps * 1e6,
                     "decode_ms_per_step": m["timing_s/multi_turn_decode"] / steps * 1e3,
                     "tool_wait_s": m["timing_s/tool_wait"],
                     "live_rows_mean": m["multi_turn/decode_row_steps"] / steps,
                     "tool_calls_mean": m["tool_calls/mean"],
                     "tool_errors_mean": m["tool_errors/mean"], "profiled": prof is not None})
    resp, tmask = batch.response_ids.cpu(), batch.tool_mask.cpu()
    lens = batch.response_mask.cpu().sum(1)
    sha = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (resp, tmask, lens))).hexdigest()
    timed = [r for r in reps if not r["profiled"]] or reps
    key = "host_us_per_step"
    out = {"machine": machine(), "versions": versions("hybridflow"), "command": command(),
           "settings": {**vars(a), "step": step_kind, "rows": rows},
           "hybridflow_path": str(Path(hybridflow.__file__).parent),
           "host_us_per_step_median": statistics.median(r[key] for r in timed),
           "rollout_sha": sha, "may_close_fraction": may_close,
           "model_tokens": int(((1 - tmask) * batch.response_mask.cpu()).sum()),
           "tool_tokens": int((tmask * batch.response_mask.cpu()).sum()), "reps": reps,
           "sample": tok.decode(resp[0, :int(lens[0])].tolist(), skip_special_tokens=False)}
    write_json(a.out, out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("sample", "machine")},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
