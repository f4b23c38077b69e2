"""Routing replay (actor.router_replay=R3) on one device: what recording costs the generator and
what replay changes in the training forward.

Builds an MoE actor (random init from the model preset, bf16 on a GPU, fp32 on CPU), generates
responses to random prompts with the in-place generator (the product's decode options for the
device: CUDA graphs on a GPU) twice, without and with recording the routed experts, then scores the
recorded batch with the training forward (the old-log-prob pass) with and without replay. Reported: generation seconds
both ways and whether recording left the sampled tokens unchanged, the records' bytes and whether
they are well formed (-1 exactly on prompt padding and each response's last token, k distinct ids
in range elsewhere), the log-prob pass seconds both ways, the router mismatch share (recorded
decisions the training router would have made otherwise) and the mean / max |training - rollout|
log-prob over response tokens with and without replay.

  python benchmarks/router_replay.py --model qwen3_moe_2b --prompts 64 --prompt-len 128 \\
      --new-tokens 256 --out benchmarks/results/router_replay_h200.json          # one H200
  python benchmarks/router_replay.py --model tiny --set model.moe.num_experts=4 \\
      --set model.moe.top_k=2 --set model.moe.moe_ffn_hidden_size=32 --prompts 4 \\
      --prompt-len 8 --new-tokens 8 --out /tmp/router_replay.json                 # CPU smoke
  add --emulate-graphs to the CPU smoke: decode through the GPU path's batch buckets, compaction
  ladder, KV windows and pre-capture warm-up calls (DecodeOptions.emulate_graphs), so an index
  that would assert on the device raises on CPU
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from run_record import command, machine, versions, write_json  # noqa: E402


def _timed(fn):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, round(time.perf_counter() - t0, 3)


def well_formed(batch, *, num_experts: int) -> bool:
    """-1 exactly where generation routed nothing; k distinct ids in [0, E) elsewhere."""
    import torch

    e = batch.experts()  # (B, P + R, L, k)
    fed = batch.token_mask().clone()
    rows = torch.arange(batch.batch_size)
    fed[rows, batch.prompt_len + batch.response_mask.sum(1) - 1] = 0
    routed = e >= 0
    if not torch.equal(routed.all(-1).all(-1), fed.bool()) or bool(routed[~fed.bool()].any()):
        return False
    ids = e[fed.bool()].long()  # (n, L, k)
    distinct = (ids.sort(-1).values.diff(dim=-1) != 0).all() if ids.shape[-1] > 1 else True
    return bool((ids < num_experts).all() and distinct)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_moe_2b", help="a model= preset (random init)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=1, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--emulate-graphs", action="store_true",
                    help="off a GPU: the graphed decode path's buckets, compaction, 64-column KV "
                         "windows and warm-ups, run eagerly")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from hybridflow.config import ParallelConfig, load_config
    from hybridflow.config_auto import resolve_auto
    from hybridflow.engine import Engine
    from hybridflow.parallel import groups
    from hybridflow.parallel.reshard import generation_params
    from hybridflow.rollout import Generator
    from hybridflow.rollout.options import DecodeOptions

    cfg, _ = resolve_auto(load_config([f"model={args.model}", *args.set]),
                          device_type="cuda" if torch.cuda.is_available() else "cpu")
    model_cfg, rollout = cfg.model, cfg.rollout  # the product's decode options on this device
    if not model_cfg.moe.enabled:
        raise ValueError(f"--model {args.model}: routing replay needs model.moe.num_experts > 0")
    rollout.n, rollout.max_new_tokens, rollout.return_logprobs = args.n, args.new_tokens, True
    rollout.max_batch_size = args.prompts * args.n
    opts = DecodeOptions.from_config(rollout)
    emulated = args.emulate_graphs and not torch.cuda.is_available()
    if emulated:  # as the GPU's auto config decodes, ladder buckets down to one row
        opts = opts.replace(emulate_graphs=True, compact_finished_rows=True, kv_window=64,
                            check_every=2, min_graphed_bucket=1)
    precision = "bf16" if torch.cuda.is_available() else "fp32"
    groups.init_distributed()
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=1)
    eng = Engine(role="actor", model_cfg=model_cfg, ctx=ctx, parallel=ParallelConfig(),
                 precision=precision, router_replay="R3")
    params = generation_params(dict(eng.module.named_parameters()), ctx, model_cfg)
    gen = Generator(model_cfg=model_cfg, params=params, tp_group=None, device=eng.device,
                    dtype=eng.tcfg.params_dtype, true_vocab_size=model_cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model_cfg.vocab_size, (args.prompt_len - i % 8,),
                             generator=g).tolist() for i in range(args.prompts)]
    kw = dict(cfg=rollout, eos_id=-1, pad_id=0, seed=1, options=opts)
    gen.generate(prompts, **kw, record_experts=True)  # warm-up: graphs for both variants
    gen.generate(prompts, **kw)
    plain, gen_s = _timed(lambda: gen.generate(prompts, **kw))
    batch, gen_record_s = _timed(lambda: gen.generate(prompts, **kw, record_experts=True))
    gen.release()
    batch = batch.to("cpu")
    record_bytes = sum(t.numel() * t.element_size()
                       for t in (batch.prompt_experts, batch.response_experts))
    mask = batch.response_mask.bool()
    res = {}
    for replay in (False, True):
        eng.compute_logprobs(batch, micro_batch_size=args.micro_batch, replay=replay)  # warm-up
        eng.replay_metrics("x")
        lp, secs = _timed(lambda: eng.compute_logprobs(batch, micro_batch_size=args.micro_batch,
                                                       temperature=rollout.temperature or 1.0,
                                                       replay=replay))
        diff = (lp - batch.rollout_logprobs)[mask].abs()
        res["replay" if replay else "no_replay"] = {
            "logprob_pass_s": secs, "mean_abs_logprob_diff": round(float(diff.mean()), 6),
            "max_abs_logprob_diff": round(float(diff.max()), 6),
            **eng.replay_metrics("router_mismatch_frac")}
        print(f"replay={replay}: {res['replay' if replay else 'no_replay']}", flush=True)
    tokens = int(batch.token_mask().sum())
    record = {"benchmark": "routing replay (R3): recording cost and training/rollout agreement",
              "decode_options": {"cuda_graphs": opts.cuda_graphs and torch.cuda.is_available(),
                                 "emulated_graphs": emulated,
                                 "compact_finished_rows": opts.compact_finished_rows,
                                 "kv_window": opts.kv_window, "compile": opts.compile},
              "workload": {"model": args.model, "overrides": args.set, "precision": precision,
                           "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                           "new_tokens": args.new_tokens, "micro_batch": args.micro_batch,
                           "num_layers": model_cfg.num_layers,
                           "num_experts": model_cfg.moe.num_experts, "top_k": model_cfg.moe.top_k,
                           "init": "random (Megatron's init_method_std)"},
              "generate_s": gen_s, "generate_recording_s": gen_record_s,
              "tokens_equal_with_recording": bool(torch.equal(plain.response_ids.cpu(),
                                                              batch.response_ids)),
              "records_well_formed": well_formed(batch, num_experts=model_cfg.moe.num_experts),
              "record_bytes": record_bytes, "tokens": tokens,
              "record_bytes_per_token": round(record_bytes / batch.input_ids().numel(), 1),
              "machine": machine(), "versions": versions("megatron-core"), "command": command(),
              **res}
    print({k: v for k, v in record.items() if k not in ("machine", "versions")}, flush=True)
    if args.out:
        write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
