"""CLI: `python -m hybridflow.cost --model qwen2_7b --gpu H200 --num-gpus 8 [--json]`, or for a trainer
config and the lengths a probe measured: `python -m hybridflow.cost --config
experiment=gsm8k_qwen_coder_0_5b --num-gpus 1 --lengths probe/metrics.jsonl`.

Refuses what the trainer refuses (a micro-batch token budget that cannot hold the longest row) with
the trainer's wording; user errors are one line, `hybridflow cost: error: ...`, exit code 2."""
from __future__ import annotations

import argparse
import sys

from hybridflow import cli
from hybridflow.config_checks import check_token_budget
from hybridflow.cost.estimate import estimate_cost
from hybridflow.cost.from_config import packed_kernel
from hybridflow.cost.gpus import GPUS, get_gpu
from hybridflow.cost.shapes import load_shape
from hybridflow.cost.workload import ALGORITHMS


@cli.tool("cost")
def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m hybridflow.cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="conf/model name, HF config.json or its directory (required "
                                    "unless --config)")
    p.add_argument("--config", nargs="+", metavar="OVERRIDE",
                   help="a trainer config as Hydra overrides (e.g. experiment=gsm8k_qwen_coder_0_5b "
                        "rollout.n=16): model, workload and layout as the trainer resolves them on "
                        "a GPU (token budgets sized for --gpu's memory); the workload flags below "
                        "are ignored, except --lengths")
    p.add_argument("--lengths", metavar="FILE",
                   help="the step's response (and prompt) lengths as a distribution: a trainer "
                        "metrics.jsonl (a probe's or a previous run's), a probe.json, or a JSON of "
                        "response_lengths / response_length_quantiles / mean,max,min,clip_ratio "
                        "(docs/cost_model.md); generation and the passes are then costed row by row")
    p.add_argument("--gpu", default="H200", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--num-gpus", type=int, default=8)
    p.add_argument("--algorithm", default="grpo", choices=ALGORITHMS)
    p.add_argument("--prompts-per-step", type=int, default=128)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=1024,
                   help="mean response length (every response, unless --response-len-max)")
    p.add_argument("--response-len-max", type=int,
                   help="the longest response of a step (rollout.max_new_tokens when some hit it): "
                        "generation decodes until it ends")
    p.add_argument("--max-new-tokens", type=int,
                   help="rollout.max_new_tokens: the cap of --lengths (default --response-len-max, "
                        "else --response-len)")
    p.add_argument("--gen-max-batch-size", type=int,
                   help="rollout.max_batch_size: rows per generation chunk (default: as memory holds)")
    p.add_argument("--batches-per-round", type=int, default=1, dest="gen_batches_per_round",
                   help="algo.dynamic_sampling.batches_per_round: prompt batches of the largest "
                        "generation call (sizes a kept generator's KV cache)")
    p.add_argument("--compact-finished-rows", action="store_true",
                   help="rollout.compact_finished_rows=true: live rows move to smaller decode buckets")
    p.add_argument("--kv-window", type=int, default=0, help="rollout.decode_kv_window (0: off)")
    p.add_argument("--dynamic-bsz", action="store_true",
                   help="algo.use_dynamic_bsz=true: --micro-batch-tokens is a token budget")
    p.add_argument("--pack-sequences", action="store_true",
                   help="algo.pack_sequences=true (with --dynamic-bsz): packed rows of real tokens")
    p.add_argument("--balance-micro-batches", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="algo.balance_micro_batches: packed micro-batches dealt evenly into the "
                        "fewest that hold the rows (default: as the trainer, on with "
                        "--pack-sequences); --no-balance-micro-batches: sorted next-fit")
    p.add_argument("--packed-attention", choices=("auto", "varlen", "flex", "fa4"),
                   default="auto",
                   help="algo.packed_attention: the packed rows' attention kernel (auto: fa4 on "
                        "compute capability 9.0+ where flash-attn-4 is installed, else varlen, "
                        "else flex)")
    p.add_argument("--no-fa4", action="store_false", dest="fa4",
                   help="the target has no flash-attn-4 (the gpu extra installs it): auto "
                        "resolves to varlen (with --config too)")
    p.add_argument("--steps", type=int)
    p.add_argument("--epochs", type=float)
    p.add_argument("--dataset-size", type=int)
    p.add_argument("--price", type=float, dest="price_per_gpu_hour", help="$ per GPU-hour")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--mini-batches", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--forward-micro-batch-tokens", type=int,
                   help="micro-batch of the forward-only passes (default: --micro-batch-tokens)")
    p.add_argument("--no-reference", action="store_false", dest="use_reference")
    p.add_argument("--skip-old-log-prob", action="store_true",
                   help="the trainer skips the old_log_prob pass (one epoch of one mini-batch)")
    p.add_argument("--keep-generator", action="store_true",
                   help="rollout.free_cache_engine=false: the KV cache stays through training")
    p.add_argument("--lm-head-chunk-tokens", type=int, default=0,
                   help="parallel.lm_head_chunk_tokens: the LM head + log-probs this many "
                        "positions at a time (0: whole)")
    p.add_argument("--decode-kernels", choices=("torch", "triton"), default="triton",
                   help="rollout.decode_kernels as generation runs it (the default auto: triton on "
                        "a GPU with a power-of-two head_dim)")
    p.add_argument("--all-columns", action="store_false", dest="own_columns",
                   help="rollout.kernel_options.own_columns_only=false: every decode row reads the "
                        "K/V of every column of its window (left padding, unwritten columns and "
                        "finished rows included); by default a triton decode row reads its own")
    p.add_argument("--rollout-quantization", choices=("none", "fp8", "int4"), default="none",
                   help="rollout.quantization: the decode step reads fp8 / int4 layer weights "
                        "and pays the quantized kernels' fitted cost; the report compares every "
                        "mode when generation is the largest stage")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="rollout.kv_cache_dtype: fp8 caches, reads and moves 1 + 4 / head_dim "
                        "bytes per K/V value (bf16: 2): more rows per generation wave, fewer KV "
                        "bytes per decode step")
    p.add_argument("--unfused-elementwise", action="store_false", dest="fused_elementwise",
                   help="parallel.fused_elementwise=false: Megatron's unfused RoPE and SwiGLU")
    p.add_argument("--train-cuda-graphs", action="store_true",
                   help="parallel.train_cuda_graphs=true: the update's layers as CUDA graphs (PP = 1, "
                        "no recompute)")
    p.add_argument("--no-grad-accum-fusion", action="store_false",
                   dest="gradient_accumulation_fusion",
                   help="parallel.gradient_accumulation_fusion=false: the layers' weight gradients "
                        "reach DDP's main_grad through a bf16 gradient and a second pass")
    p.add_argument("--no-ref-prefetch", action="store_false", dest="offload_ref_prefetch",
                   help="trainer.offload_ref_prefetch=false: an offloaded reference is copied "
                        "in the ref stage, not behind generation")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="actor.lora.rank (all-linear): grads and optimizer state only for adapters, "
                        "no reference copy; the update without the base's weight gradients, plus "
                        "the adapters' traffic and the merge before generation")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="actor.offload_optimizer=true: master weights and Adam state on the host")
    p.add_argument("--offload-grads", action="store_true",
                   help="actor.offload_grads=true: gradient buffers only in the update")
    p.add_argument("--offload-params", action="store_true",
                   help="actor.offload_params=true: the actor's weights (LoRA: its base) off the "
                        "GPU in the critic's phases and, when the generator owns its weights "
                        "(quantized or resharded), in generation")
    p.add_argument("--critic-lora-rank", type=int, default=0,
                   help="critic.lora.rank (PPO, all-linear): grads and optimizer state only for "
                        "the critic's adapters and value head")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="MoE: the experts' training GEMMs as transformer-engine's grouped GEMM "
                        "(default: megatron-core's SequentialMLP, one expert after another, as "
                        "without transformer-engine)")
    p.add_argument("--gpu-memory-gib", type=float,
                   help="the card's memory instead of --gpu's (e.g. 24 for a 24 GB card, or "
                        "trainer.gpu_memory_limit_gib)")
    p.add_argument("--calibration", help="JSON written by python -m hybridflow.cost.calibrate")
    g = p.add_argument_group("force a layout (else searched)")
    g.add_argument("--tp", type=int)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--tp-gen", type=int)
    g.add_argument("--offload-ref", action="store_true")
    g.add_argument("--recompute", action="store_true")
    g.add_argument("--ep", type=int, default=1, help="MoE: parallel.expert_parallel_size")
    g.add_argument("--etp", type=int, help="MoE: parallel.expert_tensor_parallel_size (default: tp)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    if a.config:
        return _from_config(a)
    if a.model is None:
        p.error("--model is required (or --config)")
    layout = None
    forced = [f for f, on in (("--pp", a.pp != 1), ("--tp-gen", a.tp_gen is not None),
                              ("--offload-ref", a.offload_ref), ("--recompute", a.recompute),
                              ("--ep", a.ep != 1), ("--etp", a.etp is not None)) if on]
    if forced and a.tp is None:
        p.error(f"{', '.join(forced)} force a layout and need --tp too (without --tp the "
                "layout is searched)")
    if a.tp is not None:
        layout = {"tp": a.tp, "pp": a.pp, "tp_gen": a.tp_gen, "offload_ref": a.offload_ref,
                  "recompute": a.recompute, "ep": a.ep, "etp": a.etp}
    response, flag = ((a.response_len_max, "--response-len-max") if a.response_len_max is not None
                      else (a.response_len, "--response-len"))
    for key, value in (("--micro-batch-tokens", a.micro_batch_tokens),
                       ("--forward-micro-batch-tokens", a.forward_micro_batch_tokens)):
        if value is not None:
            check_token_budget(key, value, longest=a.prompt_len + response,
                               how=f"--prompt-len + {flag} = {a.prompt_len} + {response}")
    packed = packed_kernel(a.packed_attention, gpu=get_gpu(a.gpu),
                           head_dim=load_shape(a.model).head_dim, fa4_installed=a.fa4)
    varlen = dict(gen_max_batch_size=a.gen_max_batch_size,
                  gen_batches_per_round=a.gen_batches_per_round,
                  compact_finished_rows=a.compact_finished_rows, decode_kv_window=a.kv_window,
                  dynamic_bsz=a.dynamic_bsz, pack_sequences=a.pack_sequences,
                  balanced_micro_batches=(a.pack_sequences if a.balance_micro_batches is None
                                          else a.balance_micro_batches),
                  packed_attention=packed, cdf_sampler=a.decode_kernels == "triton")
    cap = a.max_new_tokens or a.response_len_max or a.response_len
    if a.max_new_tokens is not None or a.lengths:
        varlen["max_new_tokens"] = cap
    if a.lengths:
        from hybridflow.cost.lengths import load_lengths

        varlen |= load_lengths(a.lengths, cap=cap, num_rows=a.prompts_per_step * a.samples_per_prompt)
        a.prompt_len = varlen.pop("prompt_len", a.prompt_len)
    report = estimate_cost(
        model=a.model, gpu=a.gpu, num_gpus=a.num_gpus, algorithm=a.algorithm,
        prompts_per_step=a.prompts_per_step, samples_per_prompt=a.samples_per_prompt,
        prompt_len=a.prompt_len, response_len=a.response_len,
        response_len_max=a.response_len_max, steps=a.steps, epochs=a.epochs,
        dataset_size=a.dataset_size, price_per_gpu_hour=a.price_per_gpu_hour, layout=layout,
        ppo_epochs=a.ppo_epochs, mini_batches=a.mini_batches,
        micro_batch_tokens=a.micro_batch_tokens,
        forward_micro_batch_tokens=a.forward_micro_batch_tokens, use_reference=a.use_reference,
        skip_old_log_prob=a.skip_old_log_prob, keep_generator=a.keep_generator,
        lm_head_chunk_tokens=a.lm_head_chunk_tokens, decode_kernels=a.decode_kernels,
        rollout_quantization=a.rollout_quantization, kv_cache_dtype=a.kv_cache_dtype,
        fused_elementwise=a.fused_elementwise, train_cuda_graphs=a.train_cuda_graphs,
        gradient_accumulation_fusion=a.gradient_accumulation_fusion,
        offload_ref_prefetch=a.offload_ref_prefetch, lora_rank=a.lora_rank,
        offload_optimizer=a.offload_optimizer, offload_grads=a.offload_grads,
        offload_params=a.offload_params, critic_lora_rank=a.critic_lora_rank,
        moe_grouped_gemm=a.moe_grouped_gemm, gpu_memory_gib=a.gpu_memory_gib,
        calibration=a.calibration, own_columns_only=a.own_columns and a.decode_kernels == "triton",
        **varlen)
    print(report.to_json() if a.json else report)
    return 0


def _from_config(a) -> int:
    """The report for a trainer config (`--config`), in its own layout."""
    from hybridflow.cost.from_overrides import from_overrides

    from hybridflow.config import load_config

    # the trainer's own cap (trainer.gpu_memory_limit_gib) bounds the card as --gpu-memory-gib does
    caps = [c for c in (a.gpu_memory_gib, load_config(list(a.config)).trainer.gpu_memory_limit_gib)
            if c]
    a.gpu_memory_gib = min(caps) if caps else None
    free = a.gpu_memory_gib or get_gpu(a.gpu).memory_gib
    model, plan, fields, notes = from_overrides(a.config, world_size=a.num_gpus, free_gib=free,
                                                lengths_path=a.lengths, gpu=a.gpu,
                                                fa4_installed=a.fa4)
    for note in notes:
        print(f"hybridflow cost: note: {note}", file=sys.stderr)
    report = estimate_cost(model=model, gpu=a.gpu, num_gpus=a.num_gpus, layout=plan.to_dict(),
                           steps=a.steps, epochs=a.epochs, dataset_size=a.dataset_size,
                           price_per_gpu_hour=a.price_per_gpu_hour, calibration=a.calibration,
                           gpu_memory_gib=a.gpu_memory_gib, **fields)
    print(report.to_json() if a.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
