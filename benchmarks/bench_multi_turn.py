"""Multi-turn generation with tools: how fast its decode step runs, and what a real model does.

Two modes.

`--synthetic` (the decode-speed A/B): the Qwen2.5-Coder-0.5B shape (hybridflow/conf/model/
qwen2_5_coder_0_5b.yaml) with random weights, a byte-level tokenizer padded to Qwen's vocabulary
with plain filler tokens plus the ChatML / <tool_call> specials, 64 random prompts of 192-319
tokens x n=8 = 512 rows in one chunk, 256 new tokens, temperature 1. A forced-call pattern: every
row writes 16-63 filler tokens and a calculator call (`<tool_call>{"name": "calculator", ...}
</tool_call>`), every other row a second one after more filler; after its forced tokens a row
samples freely (random weights: it runs to the budget). Every variant decodes with --kernels
(rollout.decode_kernels; auto: the single-turn step's Triton layers on a GPU, PyTorch ops on CPU).
Timed variants (a warm-up call first, which also captures the graphs; then the median of --reps
calls):
  eager            the decode step without graphs (rollout.cuda_graphs=false)
  graphed          one CUDA-graph replay per step, the whole cache attended
  graphed_windows  a graph per KV window (rollout.decode_kv_window: an eighth of the cache)
  single_turn      Generator.generate on the same rows without tools (its GPU defaults but
                   compile: Triton decode layers, graphs, windows, compaction), for the ratio
and, with a long tail of lengths (three rows in four stop 0-119 tokens after their calls),
  tail_graphed_windows          as graphed_windows
  tail_graphed_windows_compact  + rollout.compact_finished_rows (the GPU default).
With triton kernels, `*_torch` twins of graphed_windows and tail_graphed_windows_compact run the
torch step (`extend`) on the same rows (`fused_speedup`: their wall time over the fused one's).
Tool results are held and appended together (rollout.multi_turn.append_wait_steps, its default)
in every variant but the `*_at_once` twins of graphed_windows and tail_graphed_windows_compact
(append_wait_steps=0: each poll's results at once) and the `*_fed` twins
(rollout.multi_turn.append=decode: a result's tokens fed one per decode step, no extend;
`fed_speedup`: held wall time over fed) and their `*_fed_ahead` twins (+ rollout.multi_turn.
lookahead: each step launched before the previous one's tokens are read; `lookahead_speedup`). `--tool-latency-ms L --tool-jitter-ms J`: each
calculator call takes L + [0, J) ms (fixed per call; the runner's 16 threads), so results come in
spread over the steps as a sandboxed tool's do; 0 (the default): they come in together.
Per variant: wall seconds, decode steps, ms per step, the time appending tool results
(`tool_prefill_s`) in how many extend calls (`append_calls`), waiting for tools, calls per row.

    python benchmarks/bench_multi_turn.py --synthetic \
        --out benchmarks/results/multi_turn_ab_h200.json
    python benchmarks/bench_multi_turn.py --synthetic --tool-latency-ms 20 --tool-jitter-ms 40 \
        --out benchmarks/results/multi_turn_hold_h200.json  # results spread out
    python benchmarks/bench_multi_turn.py --synthetic --device cpu --dtype float32 --layers 1 \
        --vocab 1024 --prompts 2 --n 2 --max-new 128 --reps 1 --out /tmp/mt_ab.json  # CPU smoke

Real model (GGUF, GSM8K prompts, the code interpreter, `--format hermes|code`, data.system_prompt
as `--system`): wall time split into decoding, waiting for tools and appending results, turns and
calls per trajectory, the extend calls that appended results and two sample trajectories;
`--append-wait-steps 0` appends each poll's results at once (the held default otherwise).

    python benchmarks/bench_multi_turn.py --gguf FILE --data DIR/val.jsonl --prompts 64 --n 8 \
        --max-new 1024 --out results/multi_turn_h200.json

Every JSON (written atomically) holds the machine, versions and command.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402

SPECIALS = ["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>"]
CHATML_TOOLS = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN_TRUE_VOCAB = 151665


def synthetic_tokenizer(directory: Path, vocab: int):
    """Byte-level BPE (no merges): the 256 byte symbols, plain filler tokens `w<i>` up to `vocab`
    minus the specials, then the specials (EOS and pad: <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hybridflow.data.tokenizer import load_tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    table = {c: i for i, c in enumerate(alphabet)}
    table.update({f"w{i}": len(alphabet) + i for i in range(vocab - len(alphabet) - len(SPECIALS))})
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "chat_template": CHATML_TOOLS}))
    return load_tokenizer(directory)


def random_params(cfg, *, device, dtype, seed: int = 0) -> dict:
    """Megatron-named random weights of `cfg` (std 0.02, norms 1)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, device=device, dtype=torch.float32)  # noqa: E731
                    * 0.02).to(dtype)
    ones = lambda n: torch.ones(n, device=device, dtype=dtype)  # noqa: E731
    D, hd, G, H, F = (cfg.hidden_size, cfg.head_dim, cfg.num_query_groups,
                      cfg.num_attention_heads, cfg.ffn_hidden_size)
    p = {"embedding.word_embeddings.weight": r(cfg.vocab_size, D),
         "decoder.final_layernorm.weight": ones(D), "output_layer.weight": r(cfg.vocab_size, D)}
    for i in range(cfg.num_layers):
        q = f"decoder.layers.{i}."
        p[q + "input_layernorm.weight"] = ones(D)
        p[q + "pre_mlp_layernorm.weight"] = ones(D)
        p[q + "self_attention.linear_qkv.weight"] = r(G * (H // G + 2) * hd, D)
        p[q + "self_attention.linear_qkv.bias"] = r(G * (H // G + 2) * hd)
        p[q + "self_attention.linear_proj.weight"] = r(D, H * hd)
        p[q + "mlp.linear_fc1.weight"] = r(2 * F, D)
        p[q + "mlp.linear_fc2.weight"] = r(D, F)
    return p


def hold_options(a) -> dict:
    """rollout.multi_turn.append_wait_steps / append_batch_rows from the flags (None: default)."""
    return {k: v for k, v in (("append_wait_steps", a.append_wait_steps),
                              ("append_batch_rows", a.append_batch_rows)) if v is not None}


def slow_runner(latency_ms: float, jitter_ms: float):
    """A ToolRunner class whose turns take latency_ms + [0, jitter_ms) ms more (fixed per call
    by a hash of its items), for results that come in spread out as a sandbox's do."""
    import zlib

    from hybridflow.tools.runner import ToolRunner

    class SlowRunner(ToolRunner):
        def _run(self, items):
            u = zlib.crc32(repr(items).encode()) / 2 ** 32
            time.sleep((latency_ms + jitter_ms * u) / 1e3)
            return super()._run(items)

    return SlowRunner


def synthetic(a) -> dict:
    import dataclasses

    import numpy as np
    import torch
    import yaml

    from hybridflow.config import ModelConfig, MultiTurnConfig, RolloutConfig
    from hybridflow.rollout import Generator
    from hybridflow.rollout.multi_turn import generate_multi_turn
    from hybridflow.rollout.options import DecodeOptions
    from hybridflow.tools import load_tool_config
    from hybridflow.tools.formats import ToolFormat
    from hybridflow.tools.runner import ToolRunner

    root = Path(__file__).resolve().parents[1]
    spec = yaml.safe_load((root / "hybridflow/conf/model/qwen2_5_coder_0_5b.yaml").read_text())
    spec.update(num_layers=a.layers or spec["num_layers"])
    if a.vocab:
        spec.update(vocab_size=a.vocab)
    cfg = ModelConfig(**spec)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    with tempfile.TemporaryDirectory() as d:
        tok = synthetic_tokenizer(Path(d), a.vocab or QWEN_TRUE_VOCAB)
    gen = Generator(model_cfg=cfg, params=random_params(cfg, device=dev, dtype=dtype),
                    tp_group=None, device=dev, dtype=dtype, true_vocab_size=tok.vocab_size)
    rng = np.random.default_rng(0)
    fillers = tok.vocab_size - 256 - len(SPECIALS)
    filler = lambda k: (256 + rng.integers(0, fillers, k)).tolist()  # noqa: E731
    prompts = [filler(int(rng.integers(192, 320))) for _ in range(a.prompts)]
    call = lambda expr: tok.encode("<tool_call>" + json.dumps(  # noqa: E731
        {"name": "calculator", "arguments": {"expression": expr}}) + "</tool_call>")
    rows = a.prompts * a.n
    forced = [filler(16 + i % 48) + call(f"{i}*{i % 7 + 2}")
              + (filler(8 + i % 24) + call(f"{i}+1") if i % 2 else []) for i in range(rows)]
    # a long tail: three rows in four stop (EOS) 0-119 tokens after their calls, the rest run on
    tail = [f + ([] if i % 4 == 0 else filler((i * 53) % 120) + [tok.eos_id])
            for i, f in enumerate(forced)]
    tools = load_tool_config("calculator.yaml")
    mt = MultiTurnConfig(enable=True, tool_config_path="calculator.yaml", max_assistant_turns=4,
                         max_tool_response_length=256, tool_workers=16, append="prefill",
                         **hold_options(a))  # held and prefilled; fed below
    runner_cls = (slow_runner(a.tool_latency_ms, a.tool_jitter_ms)
                  if a.tool_latency_ms or a.tool_jitter_ms else ToolRunner)
    rc = RolloutConfig(n=a.n, max_new_tokens=a.max_new, temperature=1.0, max_batch_size=rows,
                       return_logprobs=True)
    cache = max(map(len, prompts)) + a.max_new
    window = max(64, -(-cache // 8 // 64) * 64)
    at_once = dataclasses.replace(mt, append_wait_steps=0)
    fed = dataclasses.replace(mt, append="decode", lookahead=False)  # fed by the decode step
    ahead = dataclasses.replace(fed, lookahead=True)  # + each step launched before the last is read
    kernels = DecodeOptions(kernels=a.kernels).resolved(dev, cfg.head_dim).kernels
    windows = DecodeOptions(kernels=kernels, kv_window=window)
    compact = DecodeOptions(kernels=kernels, kv_window=window, compact_finished_rows=True)
    variants = {  # name: (options, forced tokens per row, rollout.multi_turn)
        "eager": (DecodeOptions(kernels=kernels, cuda_graphs=False), forced, mt),
        "graphed": (DecodeOptions(kernels=kernels), forced, mt),
        "graphed_windows": (windows, forced, mt),
        "graphed_windows_at_once": (windows, forced, at_once),
        "tail_graphed_windows": (windows, tail, mt),
        "tail_graphed_windows_compact": (compact, tail, mt),
        "tail_graphed_windows_compact_at_once": (compact, tail, at_once),
        "graphed_windows_fed": (windows, forced, fed),
        "tail_graphed_windows_compact_fed": (compact, tail, fed),
        "graphed_windows_fed_ahead": (windows, forced, ahead),
        "tail_graphed_windows_compact_fed_ahead": (compact, tail, ahead)}
    if kernels == "triton":  # the torch step (extend) on the same rows, for the A/B
        variants["graphed_windows_torch"] = (windows.replace(kernels="torch"), forced, mt)
        variants["tail_graphed_windows_compact_torch"] = (compact.replace(kernels="torch"),
                                                          tail, mt)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for name, (opts, pattern, mt_v) in variants.items():
        runner = runner_cls(tools, fmt=ToolFormat("hermes", tokenizer=tok, tools=tools),
                            tokenizer=tok, mt=mt_v)
        times, metrics = [], None
        for rep in range(a.reps + 1):  # the first: warm-up (and graph capture)
            sync()
            t0 = time.perf_counter()
            batch, metrics = generate_multi_turn(gen, prompts, cfg=rc, runner=runner,
                                                 eos_id=tok.eos_id, pad_id=tok.pad_id,
                                                 seed=rep, options=opts, forced=pattern)
            sync()
            times.append(time.perf_counter() - t0)
        wall = statistics.median(times[1:])
        steps = metrics["multi_turn/decode_steps"]
        mask, tool = batch.response_mask.cpu(), batch.tool_mask.cpu()
        out[name] = {"first_call_s": times[0], "wall_s": wall, "decode_steps": steps,
                     "ms_per_step": 1e3 * wall / max(steps, 1),
                     "model_tokens": int((mask * (1 - tool)).sum()),
                     "tool_tokens": int((mask * tool).sum()),
                     "append_wait_steps": mt_v.append_wait_steps,
                     "append": mt_v.append,
                     "append_calls": metrics["multi_turn/append_calls"],
                     "fed_tool_tokens": metrics["multi_turn/fed_tool_tokens"],
                     "lookahead": mt_v.lookahead_on,
                     "host_s": metrics["timing_s/multi_turn_host"],
                     "step_wait_s": metrics["timing_s/multi_turn_step_wait"],
                     "tool_prefill_s": metrics["timing_s/tool_prefill"], "metrics": metrics}
        print(name, f"{wall:.2f}s", f"{out[name]['ms_per_step']:.2f} ms/step",
              f"calls/row {metrics['tool_calls/mean']:.2f}",
              f"append_calls {out[name]['append_calls']:.0f}",
              f"tool_prefill {out[name]['tool_prefill_s']:.3f}s", flush=True)
        runner.close()
        gen.release()  # each variant's graphs and cache go; the next captures its own
    single = RolloutConfig(n=a.n, max_new_tokens=a.max_new, temperature=1.0, max_batch_size=rows,
                           return_logprobs=True, decode_kv_window=window if dev.type == "cuda"
                           else 0, compact_finished_rows=dev.type == "cuda")
    times = []
    for rep in range(a.reps + 1):
        sync()
        t0 = time.perf_counter()
        gen.generate(prompts, cfg=single, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=rep)
        sync()
        times.append(time.perf_counter() - t0)
    out["single_turn"] = {"first_call_s": times[0], "wall_s": statistics.median(times[1:]),
                          "decode_steps": a.max_new - 1}
    print("single_turn", f"{out['single_turn']['wall_s']:.2f}s", flush=True)
    out["ratios"] = {k: out[k]["wall_s"] / out["single_turn"]["wall_s"]
                     for k in variants if not k.startswith("tail")}
    if kernels == "triton":  # wall time with the torch step / with the fused one
        out["fused_speedup"] = {k: out[k + "_torch"]["wall_s"] / out[k]["wall_s"]
                                for k in ("graphed_windows", "tail_graphed_windows_compact")}
    out["compaction_speedup"] = (out["tail_graphed_windows"]["wall_s"]
                                 / out["tail_graphed_windows_compact"]["wall_s"])
    # wall time appending each poll's results at once / held (the default), same options
    out["hold_speedup"] = {k: out[k + "_at_once"]["wall_s"] / out[k]["wall_s"]
                           for k in ("graphed_windows", "tail_graphed_windows_compact")}
    # wall time with results appended by `extend` (held) / fed through the decode step
    out["fed_speedup"] = {k: out[k]["wall_s"] / out[k + "_fed"]["wall_s"]
                          for k in ("graphed_windows", "tail_graphed_windows_compact")}
    # wall time fed step by step / fed with each step launched before the last one is read
    out["lookahead_speedup"] = {k: out[k + "_fed"]["wall_s"] / out[k + "_fed_ahead"]["wall_s"]
                                for k in ("graphed_windows", "tail_graphed_windows_compact")}
    out["settings"] = {"rows": rows, "kv_window": window, "decode_kernels": kernels,
                       "append_wait_steps": mt.append_wait_steps,
                       "append_batch_rows": mt.append_batch_rows,
                       "forced": "1-2 calculator calls per row; tail_*: 3/4 of rows stop 0-119 "
                                 "tokens after them"}
    return out


def real(a) -> dict:
    import torch

    from hybridflow.config import MultiTurnConfig, RolloutConfig
    from hybridflow.data.tokenizer import load_tokenizer
    from hybridflow.models.gguf import gguf_tokenizer_dir, load_gguf
    from hybridflow.rollout import Generator
    from hybridflow.rollout.multi_turn import generate_multi_turn
    from hybridflow.tools import load_tool_config
    from hybridflow.tools.formats import ToolFormat
    from hybridflow.tools.runner import ToolRunner

    tok = load_tokenizer(gguf_tokenizer_dir(a.gguf))
    cfg, params = load_gguf(a.gguf)
    tools = load_tool_config("code_interpreter.yaml")
    mt = MultiTurnConfig(enable=True, tool_config_path="code_interpreter.yaml", format=a.format,
                         max_assistant_turns=a.turns, tool_workers=16, **hold_options(a))
    runner = ToolRunner(tools, fmt=ToolFormat(a.format, tokenizer=tok, tools=tools),
                        tokenizer=tok, mt=mt)
    gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=a.device,
                    dtype=getattr(torch, a.dtype), true_vocab_size=tok.vocab_size)
    records = [json.loads(line) for line in open(a.data)][:a.prompts]
    prompts = []
    for r in records:
        msgs = [dict(m) for m in r["prompt"]]
        if a.system:
            msgs = [{"role": "system", "content": a.system}, *msgs]
        # the recipe renders the schemas into the template for hermes only (components.py)
        kw = {"tools": [t.schema for t in tools]} if a.format == "hermes" else {}
        prompts.append(tok.encode(tok.apply_chat_template(msgs, **kw)))
    rc = RolloutConfig(n=a.n, max_new_tokens=a.max_new, temperature=a.temperature,
                       stop_token_ids=[151643], max_batch_size=512)
    run = lambda seed: generate_multi_turn(gen, prompts, cfg=rc, runner=runner,  # noqa: E731
                                           eos_id=tok.eos_id, pad_id=tok.pad_id, seed=seed)
    if a.device == "cuda":  # warm-up (allocator, graph capture)
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
    return {"rows": batch.batch_size, "wall_s": wall,
            "model_tokens": int((mask * (1 - tool)).sum()),
            "tool_tokens": int((mask * tool).sum()), "metrics": metrics, "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", action="store_true", help="the decode-speed A/B, random weights")
    ap.add_argument("--gguf")
    ap.add_argument("--data", help="a .jsonl of verl-format GSM8K records")
    ap.add_argument("--format", default="hermes", choices=["hermes", "code"])
    ap.add_argument("--system", default=None, help="a system prompt (data.system_prompt)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=None,
                    help="default: 256 synthetic, 1024 real")
    ap.add_argument("--layers", type=int, default=None, help="synthetic: fewer layers (smoke)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="synthetic: a smaller vocabulary (smoke); default Qwen's")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--append-wait-steps", type=int, default=None,
                    help="rollout.multi_turn.append_wait_steps (synthetic: of the held variants; "
                         "default: the config's)")
    ap.add_argument("--append-batch-rows", type=int, default=None,
                    help="rollout.multi_turn.append_batch_rows (default: the config's)")
    ap.add_argument("--tool-latency-ms", type=float, default=0.0,
                    help="synthetic: each tool call takes this long (results come in spread out)")
    ap.add_argument("--tool-jitter-ms", type=float, default=0.0,
                    help="synthetic: + up to this much more per call (fixed per call)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                    help="synthetic: rollout.decode_kernels of the variants (auto: triton on a "
                         "GPU, then also *_torch twins of two variants for the A/B)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    a.max_new = a.max_new or (256 if a.synthetic else 1024)
    if not a.synthetic and not (a.gguf and a.data):
        ap.error("--gguf and --data are needed without --synthetic")
    result = synthetic(a) if a.synthetic else real(a)
    out = {"machine": machine(), "versions": versions("hybridflow"), "command": command(),
           "settings": vars(a), **result}
    write_json(a.out, out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("samples", "metrics")},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
