"""Which tool-call format does a model actually write? The first assistant turn of GSM8K prompts,
rendered as the tools recipe renders them under each candidate (format, system prompt), generated
greedily and sampled; a row counts when its text holds a call that `ToolFormat.parse` accepts
(hermes: a `<tool_call>` whose JSON parses; code: a closed ```python block).

    python benchmarks/tool_format_probe.py --gguf FILE --data DIR/val.parquet --prompts 8 \
        --max-new 256 --device cpu --dtype float32 --out benchmarks/results/tool_format_cpu.json

The JSON (written atomically) holds the machine, versions, command, per variant and mode the rows
with a parseable call, those that wrote something call-like in another shape (fenced JSON, a
```python block that never closes), and the first rows' texts.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402

CODE_SYSTEM = ("You are a helpful assistant that solves math problems with Python. Write a "
               "```python code block that computes the answer and prints it; it is run and its "
               "output is shown to you. Then give the final answer after \"####\".")
HERMES_SYSTEM = ("You are a helpful assistant. To run Python, call the code_interpreter tool: "
                 "<tool_call>{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"...\"}}"
                 "</tool_call>. Its output is shown to you. Then give the final answer after "
                 "\"####\".")
CODE_STRICT = ("You are a math assistant with a Python interpreter. Never compute by hand: first "
               "write one ```python code block that computes the answer and prints it, then stop "
               "and wait for its output. After the output, give the final answer after \"####\".")
CODE_FEWSHOT = ("You solve math word problems by writing Python. Reply with one ```python code block "
                "that computes and prints the answer; its output is shown to you, then you give the "
                "final answer after \"####\". Example:\n"
                "Question: Tom has 3 boxes of 12 pens and gives away 5 pens. How many pens are left?"
                "\n```python\nprint(3 * 12 - 5)\n```\n```output\n31\n```\nTom has 31 pens left."
                "\n#### 31")
# (name, format, system prompt or None, whether the template gets the tool schemas)
VARIANTS = [("hermes_recipe", "hermes", None, True),
            ("hermes_system", "hermes", HERMES_SYSTEM, True),
            ("code_system", "code", CODE_SYSTEM, False),
            ("code_default", "code", None, False),
            ("code_strict", "code", CODE_STRICT, False),
            ("code_fewshot", "code", CODE_FEWSHOT, False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--data", required=True, help="verl-format GSM8K .parquet or .jsonl")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled mode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names of VARIANTS to run (default: all)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch

    from hybridflow.config import RolloutConfig
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.models.gguf import gguf_tokenizer_dir, load_gguf
    from hybridflow.rollout import Generator
    from hybridflow.rollout.options import DecodeOptions
    from hybridflow.tools import load_tool_config
    from hybridflow.tools.formats import ToolFormat

    torch.set_grad_enabled(False)
    tok = load_tokenizer(gguf_tokenizer_dir(a.gguf))
    cfg, params = load_gguf(a.gguf)
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=a.device,
                    dtype=getattr(torch, a.dtype), true_vocab_size=tok.vocab_size)
    tools = load_tool_config("code_interpreter.yaml")
    schemas = [t.schema for t in tools]
    if a.data.endswith(".parquet"):
        import pandas as pd

        records = pd.read_parquet(a.data).head(a.prompts).to_dict("records")
    else:
        records = [json.loads(line) for line in open(a.data)][:a.prompts]
    chosen = [v for v in VARIANTS if a.variants is None or v[0] in a.variants.split(",")]
    prompts, owners = [], []
    for name, _, system, with_tools in chosen:
        for r in records:
            msgs = [dict(m) for m in r["prompt"]]
            if system:
                msgs = [{"role": "system", "content": system}, *msgs]
            text = tok.apply_chat_template(msgs, **({"tools": schemas} if with_tools else {}))
            prompts.append(tok.encode(text))
            owners.append(name)
    fmts = {k: ToolFormat(k, tokenizer=tok, tools=tools) for k in ("hermes", "code")}
    fenced_json = re.compile(r"```(json)?\s*\{\s*\"name\"", re.S)
    result = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", a.temperature)):
        rc = RolloutConfig(n=1, max_new_tokens=a.max_new, temperature=temperature,
                           max_batch_size=len(prompts), stop_token_ids=[151643])
        t0 = time.perf_counter()
        batch = gen.generate(prompts, cfg=rc, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=1,
                             options=DecodeOptions(kernels="torch", cuda_graphs=a.device == "cuda"))
        secs = time.perf_counter() - t0
        mask = batch.response_mask.cpu()
        texts = [tok.decode(batch.response_ids[i, :int(mask[i].sum())].tolist(),
                            skip_special_tokens=False) for i in range(len(prompts))]
        for name, kind, _, _ in chosen:
            rows = [t for t, o in zip(texts, owners) if o == name]
            parsed = sum(_parses(fmts[kind], t) for t in rows)
            result.setdefault(name, {})[mode] = {
                "rows": len(rows), "parseable_call": parsed,
                "tool_call_tag": sum("<tool_call>" in t for t in rows),
                "fenced_json_call": sum(bool(fenced_json.search(t)) for t in rows),
                "python_block_opened": sum("```python" in t for t in rows),
                "seconds_for_all_variants": secs, "texts": rows[:3]}
        print(mode, {n: result[n][mode]["parseable_call"] for n in result}, f"{secs:.0f}s",
              flush=True)
    out = {"machine": machine(), "versions": versions("hybridflow"), "command": command(),
           "settings": vars(a), "variants": [list(v) for v in chosen], "result": result}
    write_json(a.out, out)
    print(json.dumps({n: {m: r[m]["parseable_call"] for m in r} for n, r in result.items()}))


def _parses(fmt, text: str) -> bool:
    """Whether some prefix of the turn ends in a call that parses (the rollout pauses there)."""
    if fmt.kind == "code":
        at = text.find("```python")
        while at >= 0:
            end = text.find("```", at + 9)
            if end < 0:
                return False
            calls = fmt.parse(text[:end + 3])
            if calls:
                return True
            at = text.find("```python", end + 3)
        return False
    end = text.find("</tool_call>")
    if end < 0:
        return False
    calls = fmt.parse(text[:end + len("</tool_call>")]) or []
    return any(type(c).__name__ == "ToolCall" for c in calls)


if __name__ == "__main__":
    main()
