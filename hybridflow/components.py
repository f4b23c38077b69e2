"""Build what a run needs from its Config: tokenizer, dataset, sampler, engines by role.

Kept apart from trainer.py so the trainer reads as its step. Model weights come from, in order:
`model.hf_path` (Hugging Face safetensors), `model.gguf_path` (llama.cpp GGUF), or Megatron's random
init (seeded). The reference model starts as a copy of the actor's initial weights.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from hybridflow.config import Config, ModelConfig
from hybridflow.data import PromptDataset, PromptSampler, load_tokenizer, train_sentencepiece
from hybridflow.data.synthetic import make_task, tokenizer_corpus
from hybridflow.data.tokenizer import PLAIN_CHAT_FORMAT
from hybridflow.engine import Engine
from hybridflow.parallel.context import ParallelContext


def tool_schemas(cfg: Config):
    """The function schemas chat prompts are rendered with (the template's `tools=`): those of
    rollout.multi_turn's tool config in the hermes format, else None."""
    m = cfg.rollout.multi_turn
    if not m.enable or m.format != "hermes":
        return None
    from hybridflow.tools import load_tool_config

    return [t.schema for t in load_tool_config(m.tool_config_path)]


def build_tokenizer_and_dataset(cfg: Config):
    d = cfg.data
    records = None
    if d.synthetic is not None:
        records = make_task(d.synthetic, size=d.synthetic_size, seed=cfg.trainer.seed,
                            length=d.synthetic_length)
    tok_path, gguf_file = d.tokenizer or cfg.model.hf_path, None
    if tok_path is None and cfg.model.gguf_path is not None:
        from hybridflow.models.gguf import gguf_tokenizer_dir, resolve_gguf_path

        gguf_file = resolve_gguf_path(cfg.model.gguf_path)
        tok_path = gguf_tokenizer_dir(gguf_file)
    if tok_path is None:
        if records is None:
            raise ValueError("data.tokenizer is not set and the model has no hf_path: "
                             "point data.tokenizer at a tokenizer.json dir or a sentencepiece .model")
        tok_path = _demo_tokenizer(cfg, records)
    tokenizer = load_tokenizer(tok_path)
    if d.enable_thinking is not None and "enable_thinking" not in (tokenizer.chat_template or ""):
        # the switch would change nothing: refuse it rather than let the run believe it took
        raise ValueError(f"data.enable_thinking={d.enable_thinking} but the chat template of "
                         f"{tok_path} has no enable_thinking switch (Qwen3's templates have one); "
                         "set data.enable_thinking=null")
    kw = dict(tokenizer=tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
              truncation=d.truncation, enable_thinking=d.enable_thinking, tools=tool_schemas(cfg),
              system_prompt=d.system_prompt)
    if records is not None:
        dataset = PromptDataset.from_records(records, source=f"synthetic:{d.synthetic}", **kw)
    else:
        dataset = PromptDataset.from_file(d.train_files, **kw)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if tokenizer.num_plain_chat_renders and rank == 0:  # an instruct model would get a wrong format
        source = (f"{gguf_file} has no chat template (tokenizer.chat_template)" if gguf_file else
                  f"tokenizer {tok_path} has no chat template (chat_template in "
                  "tokenizer_config.json)")
        print(f"hybridflow: warning: {source}: the chat prompts of {dataset.source} are rendered "
              f"as plain text, {PLAIN_CHAT_FORMAT} (data.tokenizer can name a tokenizer directory "
              "whose tokenizer_config.json has the model's chat_template)", flush=True)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tokenizer.vocab_size} tokens but "
                         f"model.vocab_size={cfg.model.vocab_size}")
    return tokenizer, dataset, tok_path


def _demo_tokenizer(cfg: Config, records) -> str:
    """Train a character-level sentencepiece model on the task's text (rank 0 writes, all read)."""
    out = os.path.join(cfg.trainer.output_dir, "tokenizer")
    prefix = os.path.join(out, "spm")
    if torch.distributed.get_rank() == 0 and not os.path.exists(prefix + ".model"):
        os.makedirs(out, exist_ok=True)
        tmp = prefix + f".tmp{os.getpid()}"
        train_sentencepiece(lines=tokenizer_corpus(records), model_prefix=tmp,
                            vocab_size=cfg.model.vocab_size, model_type="char")
        os.replace(tmp + ".model", prefix + ".model")
        os.replace(tmp + ".vocab", prefix + ".vocab")
    torch.distributed.barrier()
    return prefix + ".model"


def build_sampler(cfg: Config, ctx: ParallelContext, dataset) -> PromptSampler:
    return PromptSampler(len(dataset), batch_size=cfg.data.prompts_per_step,
                         dp_rank=ctx.train.dp, dp_size=ctx.dp_size,
                         seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)


def build_validator(cfg: Config, ctx: ParallelContext, *, rollout, tokenizer):
    """The validation stage over data.val_files (None without them)."""
    if cfg.data.val_files is None:
        return None
    from hybridflow.validation import Validator

    d = cfg.data
    dataset = PromptDataset.from_file(d.val_files, tokenizer=tokenizer, prompt_key=d.prompt_key,
                                      max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                                      enable_thinking=d.enable_thinking, tools=tool_schemas(cfg),
              system_prompt=d.system_prompt)
    if len(dataset) < ctx.dp_size:
        raise ValueError(f"data.val_files={d.val_files} has {len(dataset)} prompts, fewer than the "
                         f"{ctx.dp_size} data-parallel replicas that share them")
    return Validator(cfg, ctx, rollout=rollout, dataset=dataset)


def build_step_consumers(cfg: Config, *, start_step: int) -> list:
    """Consumers of each step's metrics besides the logger (`on_step(step, metrics) -> stop?`,
    `on_end()`, `save_on_stop`; optionally `on_lengths(step, lengths)`, the step's trained response
    lengths, before `on_step`): the probe (trainer.probe_steps) that measures a few steps and
    forecasts the run, the time budget (trainer.time_budget_s) and the step profiler
    (trainer.profile_steps)."""
    consumers = []
    t = cfg.trainer
    if t.profile_steps:
        import torch.distributed as dist

        from hybridflow.profiling import StepProfiler

        consumers.append(StepProfiler(
            t.profile_steps, t.profile_dir or os.path.join(t.output_dir, "profile"),
            start_step=start_step, rank=dist.get_rank() if dist.is_initialized() else 0,
            with_stack=t.profile_with_stack, top=t.profile_top_kernels))
    if cfg.trainer.time_budget_s > 0:
        from hybridflow.metrics import TimeBudget

        consumers.append(TimeBudget(cfg.trainer.time_budget_s))
    if cfg.trainer.probe_steps:
        from hybridflow.probe import Probe

        consumers.append(Probe(cfg, start_step=start_step))
    return consumers


def updates_per_step(cfg: Config) -> int:
    seqs = cfg.data.prompts_per_step * cfg.rollout.n
    return cfg.algo.ppo_epochs * (seqs // cfg.algo.ppo_mini_batch_size)


def build_engines(cfg: Config, ctx: ParallelContext) -> dict[str, Engine]:
    total = cfg.trainer.total_steps * updates_per_step(cfg)  # warm-up steps do not use the schedule
    common = dict(ctx=ctx, parallel=cfg.parallel, precision=cfg.trainer.precision,
                  packed_attention=cfg.algo.packed_attention,
                  balanced_micro_batches=cfg.algo.balance_micro_batches)
    engines = {"actor": Engine(role="actor", model_cfg=cfg.model, optim=cfg.actor_optim,
                               total_updates=total, lora=cfg.actor.lora, seed=cfg.trainer.seed,
                               offload_optimizer=cfg.actor.offload_optimizer,
                               offload_grads=cfg.actor.offload_grads,
                               router_replay=cfg.actor.router_replay,
                               offload_params=cfg.actor.offload_params, **common)}
    load_pretrained(engines["actor"], cfg.model)
    a = cfg.algo
    # with LoRA the reference is the actor with its adapters off (reference_policy), not a copy
    if (a.use_kl_loss or a.use_kl_in_reward) and cfg.actor.lora.rank == 0:
        engines["ref"] = Engine(role="ref", model_cfg=cfg.model, **common)
        copy_weights(engines["actor"].module, engines["ref"].module)
    if cfg.use_critic:
        critic_cfg = cfg.critic_model or cfg.model
        engines["critic"] = Engine(role="critic", model_cfg=critic_cfg, optim=cfg.critic_optim,
                                   total_updates=total, lora=cfg.critic.lora,
                                   seed=cfg.trainer.seed, **common)
        load_pretrained(engines["critic"], critic_cfg)
    if cfg.reward.model_path is not None:
        from hybridflow.models.hf import read_hf_config

        from hybridflow.config_checks import validate_model

        rm_cfg = dataclasses.replace(read_hf_config(cfg.reward.model_path),
                                     hf_path=cfg.reward.model_path)
        validate_model(rm_cfg, tp=cfg.parallel.tensor_parallel_size,
                       pp=cfg.parallel.pipeline_parallel_size, prefix="reward model")
        if rm_cfg.vocab_size < cfg.model.vocab_size:  # it reads the actor's token ids
            raise ValueError(f"reward model {cfg.reward.model_path} has vocab_size "
                             f"{rm_cfg.vocab_size} < the actor's {cfg.model.vocab_size}: it must "
                             "share the actor's tokenizer")
        engines["reward"] = Engine(role="reward", model_cfg=rm_cfg, **common)
        load_pretrained(engines["reward"], rm_cfg)
    return engines


def reference_policy(cfg: Config, engines: dict):
    """The reference model of the run (None without a KL term): its own engine, or with LoRA the
    actor's base weights (its adapters off)."""
    if "ref" in engines or not (cfg.algo.use_kl_loss or cfg.algo.use_kl_in_reward):
        return engines.get("ref")
    from hybridflow.engine import AdapterFreeReference

    return AdapterFreeReference(engines["actor"])


def finalize_engines(engines: dict[str, Engine], tokenizer) -> None:
    """Restrict LM roles to ids the tokenizer knows; sync optimizer copies with loaded weights."""
    for eng in engines.values():
        if eng.role in ("actor", "ref"):
            eng.vocab_limit = min(eng.model_cfg.vocab_size, tokenizer.vocab_size)
        if eng.optimizer is not None:
            eng.optimizer.reload_model_params()  # fp32 / distributed copies follow loaded weights


def load_pretrained(engine: Engine, model_cfg: ModelConfig) -> None:
    if model_cfg.hf_path is None and model_cfg.gguf_path is None:
        return
    c, ctx = engine.ctx.train, engine.ctx
    kw = dict(tp_rank=c.tp, tp_size=ctx.tp_size, pp_rank=c.pp, pp_size=ctx.pp_size,
              role=engine.role, **ctx.expert_coords)
    if model_cfg.hf_path is not None:
        from hybridflow.models.hf import load_hf_weights

        load_hf_weights(engine.module, model_cfg.hf_path, model_cfg, **kw)
    else:
        from hybridflow.models.gguf import read_gguf
        from hybridflow.models.hf import load_hf_state_dict

        _, hf_sd = read_gguf(model_cfg.gguf_path)
        load_hf_state_dict(engine.module, hf_sd, model_cfg, where=model_cfg.gguf_path, **kw)


@torch.no_grad()
def copy_weights(src, dst) -> None:
    src_params = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        p.copy_(src_params[name])
