"""Multi-turn generation with tools on the real Qwen2.5-Coder-0.5B-Instruct: how long a batch of
GSM8K prompts takes when the model may call the sandboxed code interpreter (hermes format), split
into decoding, waiting for tools and appending results, with the turn and call counts.

    python benchmarks/bench_multi_turn.py --gguf FILE --data DIR/val.jsonl --prompts 64 --n 8 \
        --max-new 1024 --out results/multi_turn_h200.json
    python benchmarks/bench_multi_turn.py --gguf FILE --data DIR/val.jsonl --prompts 2 --n 1 \
        --max-new 64 --device cpu --dtype float32 --out /tmp/mt.json      # CPU smoke

The prompts are the data's chat messages rendered with the tool's schema (Qwen's template puts it in
the system prompt), plus "Use the code_interpreter tool." unless --no-hint. The JSON (written
atomically) holds the machine, versions, command, settings, wall time, the generator's metrics
(timing_s/tool_wait, timing_s/tool_prefill, num_turns/*, tool_calls/mean, tool_errors/mean,
tool_timeouts/mean), tokens generated (model / tool) and two sample trajectories.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--data", required=True, help="a .jsonl of verl-format GSM8K records")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-hint", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch

    from hybridflow.config import MultiTurnConfig, RolloutConfig
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.models.gguf import gguf_tokenizer_dir, load_gguf
    from hybridflow.rollout import Generator
    from hybridflow.rollout.multi_turn import generate_multi_turn
    from hybridflow.tools.runner import ToolRunner
    from hybridflow.tools import load_tool_config
    from hybridflow.tools.formats import ToolFormat

    tok = load_tokenizer(gguf_tokenizer_dir(a.gguf))
    cfg, params = load_gguf(a.gguf)
    tools = load_tool_config("code_interpreter.yaml")
    mt = MultiTurnConfig(enable=True, tool_config_path="code_interpreter.yaml",
                         max_assistant_turns=a.turns, tool_workers=16)
    runner = ToolRunner(tools, fmt=ToolFormat("hermes", tokenizer=tok, tools=tools),
                          tokenizer=tok, mt=mt)
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=a.device,
                    dtype=getattr(torch, a.dtype), true_vocab_size=tok.vocab_size)
    records = [json.loads(line) for line in open(a.data)][:a.prompts]
    hint = "" if a.no_hint else " Use the code_interpreter tool."
    prompts = []
    for r in records:
        msgs = [dict(m) for m in r["prompt"]]
        msgs[-1]["content"] += hint
        prompts.append(tok.encode(tok.apply_chat_template(msgs, tools=[t.schema for t in tools])))
    rc = RolloutConfig(n=a.n, max_new_tokens=a.max_new, temperature=a.temperature,
                       stop_token_ids=[151643], max_batch_size=4096)
    run = lambda seed: generate_multi_turn(gen, prompts, cfg=rc, runner=runner,  # noqa: E731
                                           eos_id=tok.eos_id, pad_id=tok.pad_id, seed=seed)
    if a.device == "cuda":  # warm-up (allocator, kernels' first launches)
        run(0)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    batch, metrics = run(1)
    if a.device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    runner.close()
    mask, tool = batch.response_mask.cpu(), batch.tool_mask.cpu()
    samples = [tok.decode(batch.response_ids[i, :int(mask[i].sum())].tolist(),
                          skip_special_tokens=False) for i in range(min(2, batch.batch_size))]
    out = {"machine": machine(), "versions": versions("hybridflow"), "command": command(),
           "settings": vars(a), "rows": batch.batch_size, "wall_s": wall,
           "model_tokens": int((mask * (1 - tool)).sum()), "tool_tokens": int((mask * tool).sum()),
           "metrics": metrics, "samples": samples}
    write_json(a.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
