"""Where a packed pass spends its time: the GSM8K step's ref and update passes through the Engine.

The cost model charges micro-batches of rows of different lengths (packed, or padded: masked
attention) their attention FLOPs once more per kernel at `masked_attention_efficiency` (0.9% of
peak, fitted on the GSM8K records; ~1.3 s of the 5 s step) without knowing which kernels it is.
This runs one step's rows (GSM8K-like lengths: 512 rows, prompts of --prompt-len, responses
log-normal with --mean / --clip / --min, cut at --cap, or a trainer step's own with --lengths-from;
token ids uniform or --ids zipf; random bf16 weights of --model)
through `Engine.compute_logprobs` (the ref pass) and `Engine.train_step` (the update) as:
- `packed`: token budgets of --forward-budget / --budget tokens, each micro-batch one packed row
  under a flex_attention document mask (algo.pack_sequences=true, algo.packed_attention=flex);
- `packed_varlen`: the same packed rows on torch's varlen_attn (FlashAttention-2 over the rows'
  cu_seqlens; algo.packed_attention=varlen, what auto picks on CUDA);
- `packed_fa4`: the same packed rows on FlashAttention-4's kernels (algo.packed_attention=fa4;
  flash-attn-4 installed, sm_90+; its prediction is varlen's);
- `packed_fa4_quack`: `packed_fa4` with the MLPs' SwiGLU inside quack's GEMMs
  (parallel.mlp_kernels=quack; its prediction is fa4's);
- the suffixes `_swiglu` (the SwiGLU's backward on kernels/swiglu_train.py,
  parallel.swiglu_backward=triton) and `_ropeqkv` (the RoPE reading q in the QKV projection's
  groups, parallel.rope_from_qkv=true), alone or both (`packed_fa4_swiglu_ropeqkv`);
- `packed_varlen_graphs`: those, the update's layers replayed as CUDA graphs over packed rows
  padded to one shape (parallel.train_cuda_graphs);
- packed micro-batches are dealt evenly into the fewest that hold the rows, as the trainer's
  default (algo.balance_micro_batches); the suffix `_nextfit` (`packed_fa4_nextfit`): sorted
  next-fit instead (algo.balance_micro_batches=false);
- `budget`: the same budgets, each micro-batch padded to its own longest row (pack_sequences=false);
- `equal`: every row the mean length (prompt + round(mean)), the same budgets: the fixed-length
  shape the calibration's other records have, at the same real tokens.
A variant named twice (`packed_fa4,packed_fa4_quack,packed_fa4`: an A/B/A order, which puts what
compiles lazily in the first pass on neither side alone) is recorded again as `variant#2`.
Per variant: seconds per pass (median of --iters after two warm-up passes), micro-batches, tokens
computed, the card's clocks while timed (`gpu_clocks`: gpu_clocks.py's summary); the cost model's
prediction of the same pass (shipped calibration); with --profile the packed passes' top CUDA
kernels (flex_attention or flash varlen, GEMMs, log-prob kernels, gathers).

  python benchmarks/bench_packed_pass.py --out benchmarks/results/packed_pass_h200.json --profile
  python benchmarks/bench_packed_pass.py --variants packed,packed_varlen --profile \\
      --out benchmarks/results/packed_varlen_h200.json  # flex vs varlen, ~2 min on one H200
  python benchmarks/bench_packed_pass.py --device cpu --model tiny --rows 16 --prompt-len 8 \\
      --mean 12 --cap 32 --min 4 --forward-budget 256 --budget 128 --iters 1 \\
      --out /tmp/pp.json  # CPU smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # profile_decode's trace helpers
from benchmarks.run_record import command, machine, versions, write_json  # noqa: E402
from gpu_clocks import Sampler, summarise  # noqa: E402


def token_ids(shape, vocab: int, g: torch.Generator, ids: str = "uniform") -> torch.Tensor:
    """Token ids 1..vocab-1: uniform, or `zipf` (the k-th most frequent id drawn with weight
    1 / k, over a random order of the vocabulary: text's repeated tokens, which the embedding's
    backward sums onto the same rows)."""
    if ids == "uniform":
        return torch.randint(1, vocab, shape, generator=g)
    if ids != "zipf":
        raise ValueError(f"--ids {ids!r}: expected uniform or zipf")
    rank = torch.multinomial(1.0 / torch.arange(1, vocab), int(torch.Size(shape).numel()),
                             replacement=True, generator=g)
    return (torch.randperm(vocab - 1, generator=g)[rank] + 1).view(shape)


def make_batch(prompt_len: int, responses: list[int], vocab: int, seed: int = 0,
               ids: str = "uniform"):
    from hybridflow.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    b, r = len(responses), max(responses)
    prompt_mask = torch.ones(b, prompt_len, dtype=torch.long)
    response_mask = (torch.arange(r)[None] < torch.tensor(responses)[:, None]).long()
    return RolloutBatch(
        prompt_ids=token_ids((b, prompt_len), vocab, g, ids), prompt_mask=prompt_mask,
        response_ids=token_ids((b, r), vocab, g, ids) * response_mask,
        response_mask=response_mask, group_ids=torch.arange(b) // 8, indices=torch.arange(b),
        old_logprobs=-3.0 + 0.1 * torch.randn(b, r, generator=g),
        ref_logprobs=-3.0 + 0.1 * torch.randn(b, r, generator=g),
        advantages=torch.randn(b, 1, generator=g) * response_mask)


def timed(fn, iters: int, cuda: bool, warmup: int = 2) -> list[float]:
    for _ in range(warmup):  # compiles (the second pass's shapes compile dynamic), allocator
        fn()
    out = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def top_kernels(fn, rows: int = 80) -> dict:
    """The pass's CUDA kernels: the top `rows` by time, their sum and the wall time around them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    def us(e):  # (torch 2.4+: device_time_total; older: cuda_time_total)
        return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)

    ev = sorted(prof.key_averages(), key=lambda e: -us(e))
    return {"wall_s": wall, "kernel_s": sum(us(e) for e in ev) / 1e6,
            "launches": sum(e.count for e in ev),
            "top": [{"name": e.key[:120], "cuda_s": us(e) / 1e6, "calls": e.count}
                    for e in ev[:rows]]}


SYNCS = ("Memcpy DtoH", "DeviceSelect", "DeviceCompact")


def timeline(fn, device, *, stacks: bool = False) -> dict:
    """One traced pass: the device's idle time split by the engine's ranges ("engine.forward", ...;
    gpu_idle) and by the host op whose kernel ended each gap, and the launchers of its
    device-to-host copies and stream compactions (each one a wait for the GPU); `stacks`: another
    pass traced with Python stacks, whose `sync_lines` name the lines that launched them."""
    from profile_decode import gpu_idle, traced

    from hybridflow.profiling import idle_by_launcher

    t = traced(fn, device)
    out = {"by_stage": gpu_idle([k[:2] for k in t["kernels"]], t["host"], prefix="engine."),
           "by_launcher": idle_by_launcher(t["kernels"]), "syncs": t["launched"](SYNCS)}
    if stacks:
        out["sync_lines"] = traced(fn, device, stacks=True)["launched"](SYNCS)
    return out


def predicted(model_cfg, *, prompt_len, lengths, budget, fbudget, pack: bool, equal: bool,
              device: str, kernel: str = "flex", gpu: str = "H200", graphs: bool = False,
              lm_head_chunk: int = 0, balanced: bool = False) -> dict:
    from hybridflow.cost import estimate_step_time

    work = dict(algorithm="grpo", prompts_per_step=len(lengths) // 8, samples_per_prompt=8,
                prompt_len=prompt_len, micro_batch_tokens=budget, forward_micro_batch_tokens=fbudget,
                skip_old_log_prob=True, dynamic_bsz=True, pack_sequences=pack,
                balanced_micro_batches=pack and balanced, packed_attention=kernel,
                train_cuda_graphs=graphs,
                lm_head_chunk_tokens=lm_head_chunk,
                decode_kernels="triton" if device == "cuda" else "torch")
    if equal:
        work["response_len"] = round(statistics.fmean(lengths))
        work["max_new_tokens"] = work["response_len"]
    else:
        work["response_lengths"] = list(lengths)
        work["max_new_tokens"] = max(lengths)
    t = estimate_step_time(model=model_cfg, gpu=gpu, num_gpus=1, layout={"tp": 1}, **work)
    return {"ref": t["ref"], "update_actor": t["update_actor"]}


def add_length_args(ap: argparse.ArgumentParser) -> None:
    """The GSM8K step's rows and response-length distribution (--rows ... --cap)."""
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=105)
    ap.add_argument("--mean", type=float, default=300.0)
    ap.add_argument("--clip", type=float, default=0.0078, help="share of rows at the cap")
    ap.add_argument("--min", type=float, default=93.0, help="the shortest response")
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--lengths-from", metavar="FILE:STEP",
                    help="one step's response lengths from a trainer's rollout_lengths.jsonl "
                         "(instead of --rows / --mean / --clip / --min)")
    ap.add_argument("--ids", default="uniform", choices=("uniform", "zipf"),
                    help="token ids: uniform, or zipf (text's repeated tokens)")


def gsm8k_lengths(a) -> list:
    """The response lengths of `a.rows` rows fitted to add_length_args' statistics (cost.lengths),
    or with --lengths-from FILE:STEP one step's own (a trainer's rollout_lengths.jsonl)."""
    if getattr(a, "lengths_from", None):
        path, _, step = a.lengths_from.rpartition(":")
        if not path or not step.isdigit():
            raise SystemExit(f"--lengths-from {a.lengths_from!r}: expected FILE:STEP")
        for line in open(path):
            rec = json.loads(line) if line.strip() else {}
            if rec.get("step") == int(step):
                return [int(x) for x in rec["response_lengths"]]
        raise SystemExit(f"--lengths-from: no step {step} in {path}")
    from hybridflow.cost.lengths import fit_stats
    from hybridflow.cost.varlen import row_lengths
    from hybridflow.cost.workload import Workload

    pts = fit_stats(mean=a.mean, cap=a.cap, clip_ratio=a.clip, shortest=a.min, rows=a.rows, k=a.rows)
    return [int(x) for x in row_lengths(Workload(prompts_per_step=1, samples_per_prompt=1,
                                                 response_lengths=pts), a.rows)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2_5_coder_0_5b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    add_length_args(ap)
    ap.add_argument("--forward-budget", type=int, default=40960)
    ap.add_argument("--budget", type=int, default=20480)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--lm-head-chunk-tokens", type=int, default=0,
                    help="parallel.lm_head_chunk_tokens: the LM head and log-probs in chunks "
                         "(the GSM8K update at a 40,960-token budget ran with 4096)")
    ap.add_argument("--variants", default="packed,packed_varlen,budget,equal")
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of the packed passes")
    ap.add_argument("--timeline", action="store_true",
                    help="the packed passes traced: the GPU's idle time by the engine's stage and by "
                         "the host op it waited for, and what launches the device-to-host copies")
    ap.add_argument("--timeline-stacks", action="store_true",
                    help="with --timeline: one more pass traced with Python stacks, naming the "
                         "lines that launch each device-to-host copy (slower; not timed)")
    ap.add_argument("--megatron-optimizer-fallbacks", action="store_true",
                    help="keep Megatron's local grad-norm / scale fallbacks (a sync per tensor) "
                         "instead of parallel/multi_tensor.py's foreach kernels: the A/B of them")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig, OptimConfig, ParallelConfig
    from hybridflow.cost.shapes import load_shape
    from hybridflow.engine import Engine
    from hybridflow.parallel import groups
    from hybridflow.probe import gpu_name

    cuda = a.device == "cuda"
    if a.megatron_optimizer_fallbacks:
        from hybridflow.parallel import multi_tensor

        multi_tensor.install = lambda: None
    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    # packing needs our SDPA attention (transformer-engine's, where installed, takes no BlockMask)
    model_cfg = dataclasses.replace(load_shape(a.model), attention_backend="sdpa")
    lengths = gsm8k_lengths(a)
    a.rows = len(lengths)  # --lengths-from: the step's own rows
    precision = "bf16" if cuda else "fp32"
    par = ParallelConfig(use_distributed_optimizer=False,
                         lm_head_chunk_tokens=a.lm_head_chunk_tokens)
    pairs = {}

    def engines(kernel: str, graphs: bool = False, balanced: bool = False, mlp: str = "torch",
                swiglu: str = "compiled", rope_qkv: bool = False):
        """(ref, actor) whose packed micro-batches run `kernel` (`graphs`: the actor's update as
        CUDA graphs, parallel.train_cuda_graphs; `balanced`: algo.balance_micro_batches; `mlp`:
        parallel.mlp_kernels; `swiglu`: parallel.swiglu_backward; `rope_qkv`:
        parallel.rope_from_qkv); one pair alive at a time."""
        key = (kernel, graphs, balanced, mlp, swiglu, rope_qkv)
        if key not in pairs:
            pairs.clear()
            gc.collect()  # Megatron's modules hold reference cycles
            torch.cuda.empty_cache() if cuda else None
            rpar = dataclasses.replace(par, mlp_kernels=mlp, swiglu_backward=swiglu,
                                       rope_from_qkv=rope_qkv)
            apar = dataclasses.replace(rpar, train_cuda_graphs=graphs)
            kw = dict(packed_attention=kernel, balanced_micro_batches=balanced)
            pairs[key] = (
                Engine(role="ref", model_cfg=model_cfg, ctx=ctx, parallel=rpar, precision=precision,
                       **kw),
                Engine(role="actor", model_cfg=model_cfg, ctx=ctx, parallel=apar,
                       precision=precision, optim=OptimConfig(lr=1e-7, clip_grad=1.0),
                       total_updates=1000, **kw))
        return pairs[key]

    algo = AlgoConfig(loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.001)
    results = {}
    for variant in a.variants.split(","):
        ref = actor = fwd = upd = None  # the last variant's engines go before the next are built
        resp = [round(statistics.fmean(lengths))] * a.rows if variant == "equal" else lengths
        # on the host, as the trainer hands it to the passes (they select, pack and copy it)
        batch = make_batch(a.prompt_len, resp, model_cfg.vocab_size, ids=a.ids)
        pack = variant.startswith("packed")
        graphs = variant == "packed_varlen_graphs"
        balanced = pack and "_nextfit" not in variant  # algo.balance_micro_batches
        if pack:
            kernel = next((k for k in ("varlen", "fa4") if variant.startswith("packed_" + k)),
                          "flex")
        else:  # the unpacked variants never pack: an alive pair with an eager update serves them
            kernel = next((k for k, graphed, *_ in pairs if not graphed), "flex")
        mlp = "quack" if "_quack" in variant else "torch"  # parallel.mlp_kernels
        try:  # quack where it cannot run, varlen where it cannot (CPU, fp32, an older torch):
            # recorded as skipped
            ref, actor = engines(kernel, graphs, balanced, mlp,
                                 swiglu="triton" if "_swiglu" in variant else "compiled",
                                 rope_qkv="_ropeqkv" in variant)
            if pack:
                actor.packed_kernel()
        except ValueError as e:
            results[variant] = {"skipped": str(e)}
            print(f"{variant:13s} skipped: {e}", flush=True)
            continue
        loss_fn = actor_objective(algo, num_tokens=int(batch.response_mask.sum()), num_seqs=a.rows)

        def fwd():
            ref.compute_logprobs(batch, micro_batch_size=a.rows, max_tokens=a.forward_budget, pack=pack)

        def upd():
            actor.train_step(batch, loss_fn, micro_batch_size=a.rows, max_tokens=a.budget,
                             pack=pack, need_entropy=True)

        micro_f, _ = ref._micro_batches(batch, micro_batch_size=a.rows, max_tokens=a.forward_budget,
                                        pack=pack)
        micro_u, _ = actor._micro_batches(batch, micro_batch_size=a.rows, max_tokens=a.budget,
                                          pack=pack)
        assert not pack or actor.packed_kernel() == kernel, (variant, actor.packed_kernel())

        def computed(micro):   # tokens the micro-batches compute (a packed row: its real tokens)
            return sum(int(p.input_ids.numel()) if p is not None else int(mb.input_ids().numel())
                       for mb, _, p in micro)

        with tempfile.TemporaryDirectory() as tmp:  # what the card ran at while timed
            with Sampler(os.path.join(tmp, "clocks.csv"), interval_ms=250):
                ref_s, update_s = timed(fwd, a.iters, cuda), timed(upd, a.iters, cuda)
            clocks = summarise(os.path.join(tmp, "clocks.csv"))
        r = {"ref_s": ref_s, "update_s": update_s, "gpu_clocks": clocks,
             "ref_micro_batches": len(micro_f), "update_micro_batches": len(micro_u),
             "ref_tokens_computed": computed(micro_f), "update_tokens_computed": computed(micro_u),
             "real_tokens": int(batch.token_mask().sum()),
             "packed_attention": actor.packed_kernel() if pack else None,
             "predicted_s": predicted(model_cfg, prompt_len=a.prompt_len, lengths=resp,
                                      budget=a.budget, fbudget=a.forward_budget, pack=pack,
                                      equal=variant == "equal", device=a.device,
                                      kernel={"fa4": "varlen"}.get(kernel, kernel) if pack
                                      else "flex", gpu=gpu_name() or "H200",
                                      graphs=graphs, lm_head_chunk=a.lm_head_chunk_tokens,
                                      balanced=balanced)}
        r["ref_median_s"], r["update_median_s"] = (statistics.median(r["ref_s"]),
                                                   statistics.median(r["update_s"]))
        if a.profile and cuda and pack:
            r["ref_top_kernels"], r["update_top_kernels"] = top_kernels(fwd), top_kernels(upd)
        if a.timeline and pack:
            st = a.timeline_stacks
            r["ref_timeline"], r["update_timeline"] = (timeline(fwd, ctx.device, stacks=st),
                                                       timeline(upd, ctx.device, stacks=st))
        # a variant named again (an A/B/A order) is kept beside the first: variant#2, ...
        again = sum(k.split("#")[0] == variant for k in results)
        results[variant if not again else f"{variant}#{again + 1}"] = r
        print(f"{variant:13s} ref {r['ref_median_s']:.3f} s (pred {r['predicted_s']['ref']:.3f}), "
              f"update {r['update_median_s']:.3f} s (pred {r['predicted_s']['update_actor']:.3f}), "
              f"micro {r['ref_micro_batches']}/{r['update_micro_batches']}, "
              f"tokens {r['ref_tokens_computed']}/{r['update_tokens_computed']} "
              f"(real {r['real_tokens']})", flush=True)
    write_json(a.out, {"benchmark": "packed vs padded token-budget passes at GSM8K lengths",
                       "model": a.model,
                       "optimizer_helpers": ("megatron fallbacks" if a.megatron_optimizer_fallbacks
                                             else "foreach"), "machine": machine(),
                       "versions": versions("megatron-core"), "command": command(),
                       "lengths": {"rows": a.rows, "prompt_len": a.prompt_len,
                                   "response_mean": statistics.fmean(lengths),
                                   "response_max": max(lengths), "cap": a.cap,
                                   "from": a.lengths_from, "ids": a.ids},
                       "budgets": {"forward": a.forward_budget, "update": a.budget},
                       "lm_head_chunk_tokens": a.lm_head_chunk_tokens,
                       "results": results})
    print(f"wrote {a.out}")
    groups.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
