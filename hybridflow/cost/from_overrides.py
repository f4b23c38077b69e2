"""The cost model's view of a trainer config given as Hydra overrides (`python -m hybridflow.cost
--config ...`): the config composed, its auto options resolved as on a GPU, the token budgets sized,
then `from_config`'s Plan and Workload fields. Apart from from_config.py because resolving the auto
options (config_auto) itself asks the cost model (from_config) for memory."""

from __future__ import annotations

from hybridflow.cost.from_config import plan_for, workload_fields


def from_overrides(overrides: list[str], *, world_size: int, free_gib: float,
                   lengths_path: str | None = None, gpu: str = "H200",
                   fa4_installed: bool = True) -> tuple:
    """(ModelConfig, Plan, Workload fields, notes) of the trainer config that `overrides` compose (e.g.
    ["experiment=gsm8k_qwen_coder_0_5b"]), its auto options resolved as on a GPU with `free_gib`
    free (token budgets included) and the packed-attention kernel as on `gpu` (`fa4_installed`:
    whether flash-attn-4 is there); `lengths_path`: the step's lengths
    (cost.lengths.load_lengths: a metrics.jsonl, probe.json or lengths JSON), else every response
    runs to the cap."""
    from hybridflow.config import load_config
    from hybridflow.config_auto import budgets_unset, resolve_auto, size_for_memory
    from hybridflow.cost.lengths import load_lengths

    asked = load_config(list(overrides))
    cfg, _ = resolve_auto(asked, device_type="cuda")
    notes = []
    if budgets_unset(cfg):
        cfg, lines = size_for_memory(cfg, asked=asked.rollout, world_size=world_size,
                                     free_gib=free_gib)
        notes += lines  # the trainer's `auto:` lines for these choices
    a, r, d = cfg.algo, cfg.rollout, cfg.data
    kernels = r.decode_kernels
    if kernels == "auto":   # the generator's choice on a GPU
        pow2 = cfg.model.head_dim >= 16 and not cfg.model.head_dim & (cfg.model.head_dim - 1)
        kernels = "triton" if pow2 and not cfg.model.moe.enabled else "torch"
    lengths = dict(prompt_len=d.max_prompt_length, response_len=r.max_new_tokens)
    if lengths_path is not None:
        lengths |= load_lengths(lengths_path, cap=r.max_new_tokens,
                                num_rows=d.prompts_per_step * r.n)
    if a.dynamic_sampling.enable and "gen_rounds" not in lengths:
        notes.append("the config samples dynamically (algo.dynamic_sampling); without a probe's "
                     "metrics.jsonl (its dynamic_sampling/rounds and /batches) generation is costed "
                     "as one prompt batch per step")
    return (cfg.model, plan_for(cfg, world_size),
            workload_fields(cfg, decode_kernels=kernels, lengths=lengths, gpu=gpu,
                            fa4_installed=fa4_installed), notes)
