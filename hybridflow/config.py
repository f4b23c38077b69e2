"""Typed configuration schemas for every config group, and their validation.

Hydra YAML under `conf/` only sets values over these dataclasses: an unknown key is an error, not a
silently ignored typo. `load_config(overrides)` composes `conf/ppo.yaml` with command-line overrides,
merges it onto the schema and returns a `Config`; `validate(cfg, world_size)` checks the cross-field
rules (parallel sizes against world size and model shape, algorithm options) and raises `ValueError`
naming the key, the value and what was expected.
conf/ is read as the package `hybridflow.conf` (`CONF_PACKAGE`: inside a wheel, or through the
hybridflow/conf link in a checkout), never by a path beside the source, so an installed package runs
from any directory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from hybridflow.model_config import ModelConfig  # the model group's schema, with its derived counts

CONF_PACKAGE = "hybridflow.conf"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True  # only takes effect when DP > 1


@dataclass
class RolloutConfig:
    tensor_parallel_size: Optional[int] = None  # TP_g; None: same as training TP
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    max_batch_size: int = 256  # sequences per generate call on a rank; larger batches are chunked
    stop_token_ids: list = field(default_factory=list)  # besides the tokenizer's EOS
    cuda_graphs: bool = True  # capture the decode step on GPU
    return_logprobs: bool = False
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)


@dataclass
class DataConfig:
    train_files: Optional[str] = None  # .jsonl / .parquet in verl's format
    val_files: Optional[str] = None  # held-out prompts, same format; scored every trainer.val_every
    synthetic: Optional[str] = None  # name of a built-in synthetic task (the CPU demo)
    synthetic_size: int = 2000
    tokenizer: Optional[str] = None  # tokenizer.json dir or sentencepiece .model; default: model's
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    truncation: str = "error"  # error | left | right
    prompts_per_step: int = 8
    shuffle: bool = True


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong penalty (verl's reward_model.overlong_buffer): the score of a response
    longer than rollout.max_new_tokens - len falls linearly, to -penalty_factor at max_new_tokens."""
    enable: bool = False
    len: int = 0  # tokens before the maximum where the penalty ramps (DAPO: 4096 of 20480)
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    fn: Optional[str] = "default"  # registered name, `module:function`, `/path/file.py:function`;
    # null: no rule reward (reward model only)
    model_path: Optional[str] = None  # HF reward-model checkpoint (*ForSequenceClassification)
    model_weight: float = 1.0  # score = rule score + model_weight * reward-model score
    # rule rewards reported on validation beside `fn` (e.g. [gsm8k_strict]); they do not train
    val_fns: list = field(default_factory=list)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): drop the groups whose scores are all
    equal and generate more until data.prompts_per_step informative groups are found, at most
    max_rounds generation rounds per step (verl's max_num_gen_batches). When the cap is hit the step
    trains anyway, topped up with uninformative groups (verl raises instead; see
    hybridflow/rollout/dynamic_sampling.py)."""
    enable: bool = False
    max_rounds: int = 10


@dataclass
class AlgoConfig:
    adv_estimator: str = "gae"  # gae (PPO with critic) | grpo | grpo_no_std | rloo | reinforce_plus_plus ...
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    policy_loss: str = "vanilla"  # vanilla | gspo | gspo_token
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)
    loss_agg_mode: str = "token-mean"
    # the constant of seq-mean-token-sum-norm (verl's loss_scale_factor); None: rollout.max_new_tokens
    loss_scale_factor: Optional[float] = None
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    # truncated importance sampling: policy loss x min(pi_old / pi_rollout, cap) per token (verl's
    # actor.tis_imp_ratio_cap; e.g. 2.0); needs rollout.return_logprobs. None: off
    tis_imp_ratio_cap: Optional[float] = None
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    cliprange_value: float = 0.5
    entropy_coeff: float = 0.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    kl_horizon: int = 10000
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    ppo_epochs: int = 1
    # Batch sizes as verl names them: the mini-batch is GLOBAL (sequences per optimizer step, over
    # all DP ranks); micro-batches are PER GPU (sequences per forward/backward on one rank).
    ppo_mini_batch_size: int = 8
    micro_batch_size_per_gpu: int = 4
    # sequences per forward-only micro-batch on one rank (old/ref log-probs, values); None: the
    # training micro-batch. Larger means fewer kernel launches and TP collectives per pass.
    forward_micro_batch_size_per_gpu: Optional[int] = None


@dataclass
class OptimConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine


@dataclass
class TrainerConfig:
    total_steps: int = 20
    seed: int = 1
    output_dir: str = "outputs/run"
    precision: str = "fp32"  # fp32 | bf16
    critic_warmup: int = 0  # steps that update only the critic
    sft_warmup_steps: int = 0  # supervised steps on reference answers before RL (synthetic tasks)
    sft_lr: Optional[float] = None  # learning rate of the warm-up; None: actor_optim.lr
    save_every: int = 0  # 0: only at the end
    save_final: bool = True  # checkpoint when training ends
    resume: bool = True  # continue from <output_dir>/checkpoints/latest when present
    probe_steps: int = 0  # >0: run N steps, write probe.json (time/cost forecast), stop
    # >0: stop cleanly, with a checkpoint, before a step would end past this many seconds of
    # training (a SLURM or device time limit); `trainer.resume=true` continues from there
    time_budget_s: float = 0.0
    price_per_gpu_hour: Optional[float] = None  # for the probe's cost; None: the GPU's default
    offload_ref: bool = False
    # Python GC: N > 0 turns automatic collection off during training and collects every N steps
    # (at the start of the step, timed as timing_s/gc), as Megatron's --manual-gc: automatic
    # collections at random points stall every rank of a collective; 0: Python's default.
    gc_interval: int = 1
    # validation (verl's trainer.test_freq): greedy decoding over data.val_files every N steps
    val_every: int = 0  # 0: never during training
    val_before_train: bool = False  # score the starting model (step 0) first
    val_max_new_tokens: Optional[int] = None  # None: rollout.max_new_tokens
    val_log_generations: int = 8  # rows appended to <output_dir>/val_generations.jsonl per validation
    progress_bar: bool = True
    tensorboard: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    critic_model: Optional[ModelConfig] = None  # None: same shape as the actor
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor_optim: OptimConfig = field(default_factory=OptimConfig)
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def use_critic(self) -> bool:
        return self.algo.adv_estimator == "gae"


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {sorted(allowed)}")


def _positive(key: str, value) -> None:
    if value is None or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive number")


def validate_model(cfg: ModelConfig, *, tp: int, pp: int, prefix: str = "model") -> None:
    for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "vocab_size"):
        _positive(f"{prefix}.{k}", getattr(cfg, k))
    _one_of(f"{prefix}.attention_backend", cfg.attention_backend, {"auto", "sdpa", "te", "local"})
    if cfg.num_attention_heads % cfg.num_query_groups:
        raise ValueError(
            f"{prefix}.num_query_groups={cfg.num_query_groups} must divide "
            f"{prefix}.num_attention_heads={cfg.num_attention_heads}")
    if cfg.kv_channels is None and cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"{prefix}.hidden_size={cfg.hidden_size} is not divisible by "
                         f"{prefix}.num_attention_heads={cfg.num_attention_heads}; set kv_channels")
    for k in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(cfg, k) % tp:
            raise ValueError(f"parallel.tensor_parallel_size={tp} must divide {prefix}.{k}="
                             f"{getattr(cfg, k)}")
    if cfg.num_layers % pp:
        raise ValueError(f"parallel.pipeline_parallel_size={pp} must divide "
                         f"{prefix}.num_layers={cfg.num_layers}")


def validate(cfg: Config, *, world_size: int) -> None:
    """Cross-field checks; raises ValueError naming the offending key."""
    p = cfg.parallel
    _positive("parallel.tensor_parallel_size", p.tensor_parallel_size)
    _positive("parallel.pipeline_parallel_size", p.pipeline_parallel_size)
    mp = p.tensor_parallel_size * p.pipeline_parallel_size
    if world_size % mp:
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tensor_parallel_size="
            f"{p.tensor_parallel_size} x parallel.pipeline_parallel_size={p.pipeline_parallel_size}")
    if p.sequence_parallel and p.tensor_parallel_size == 1:
        raise ValueError("parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1")
    validate_model(cfg.model, tp=p.tensor_parallel_size, pp=p.pipeline_parallel_size)
    if cfg.critic_model is not None:
        validate_model(cfg.critic_model, tp=p.tensor_parallel_size, pp=p.pipeline_parallel_size,
                       prefix="critic_model")
    dp = world_size // mp

    r = cfg.rollout
    tp_g = r.tensor_parallel_size or p.tensor_parallel_size
    if p.tensor_parallel_size % tp_g:
        raise ValueError(f"rollout.tensor_parallel_size={tp_g} must divide "
                         f"parallel.tensor_parallel_size={p.tensor_parallel_size}")
    _positive("rollout.max_new_tokens", r.max_new_tokens)
    _positive("rollout.n", r.n)
    if r.temperature < 0:
        raise ValueError(f"rollout.temperature={r.temperature} must be >= 0 (0 means greedy)")
    if not 0.0 < r.top_p <= 1.0:
        raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1]")

    if cfg.reward.fn is None and cfg.reward.model_path is None:
        raise ValueError("reward.fn is null and reward.model_path is not set: nothing would score "
                         "the responses")
    t, d = cfg.trainer, cfg.data
    if t.val_every < 0:
        raise ValueError(f"trainer.val_every={t.val_every} must be >= 0 (0: no validation during "
                         "training)")
    if (t.val_every or t.val_before_train) and d.val_files is None:
        raise ValueError("trainer.val_every / trainer.val_before_train need data.val_files (a "
                         ".jsonl/.parquet of held-out prompts)")
    if t.val_max_new_tokens is not None:
        _positive("trainer.val_max_new_tokens", t.val_max_new_tokens)
    if (d.val_files is not None or cfg.reward.val_fns) and cfg.reward.fn is None:
        raise ValueError("validation scores with rule rewards: set reward.fn (data.val_files or "
                         "reward.val_fns is set while reward.fn is null)")
    if (d.train_files is None) == (d.synthetic is None):
        raise ValueError("set exactly one of data.train_files (a .jsonl/.parquet path) and "
                         "data.synthetic (a built-in task name)")
    _one_of("data.truncation", d.truncation, {"error", "left", "right"})
    if d.prompts_per_step % dp:
        raise ValueError(f"data.prompts_per_step={d.prompts_per_step} must be divisible by the "
                         f"data-parallel size {dp}")

    a = cfg.algo
    from hybridflow.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES  # registries live with them

    _one_of("algo.adv_estimator", a.adv_estimator, set(ADVANTAGE_ESTIMATORS))
    _one_of("algo.policy_loss", a.policy_loss, set(POLICY_LOSSES))
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1.0:
        raise ValueError(f"algo.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual-clip bound) or null")
    _validate_recipes(cfg)
    _one_of("algo.kl_ctrl", a.kl_ctrl, {"fixed", "adaptive"})
    for key in ("kl_penalty", "kl_loss_type"):
        _one_of(f"algo.{key}", getattr(a, key), {"k1", "k2", "k3", "abs"})
    if a.adv_estimator != "gae" and r.n < 2 and a.adv_estimator != "reinforce_plus_plus":
        raise ValueError(f"algo.adv_estimator={a.adv_estimator} compares samples of one prompt: "
                         f"set rollout.n >= 2 (got {r.n})")
    for key in ("ppo_mini_batch_size", "micro_batch_size_per_gpu", "ppo_epochs"):
        _positive(f"algo.{key}", getattr(a, key))
    _positive("data.prompts_per_step", d.prompts_per_step)
    mbs = a.micro_batch_size_per_gpu
    pp_uneven = p.pipeline_parallel_size > 1 and (d.prompts_per_step // dp) % mbs
    if cfg.trainer.sft_warmup_steps > 0 and pp_uneven:  # PP sends fixed-size micro-batches
        raise ValueError(f"algo.micro_batch_size_per_gpu={mbs} (per GPU) must divide the warm-up "
                         f"batch per DP rank data.prompts_per_step / DP = {d.prompts_per_step} / "
                         f"{dp} when parallel.pipeline_parallel_size > 1")
    seqs = d.prompts_per_step * r.n
    if seqs % a.ppo_mini_batch_size:
        raise ValueError(f"algo.ppo_mini_batch_size={a.ppo_mini_batch_size} (global) must divide "
                         f"the sequences per step data.prompts_per_step x rollout.n = {seqs}")
    fmbs = a.forward_micro_batch_size_per_gpu
    if fmbs is not None and (fmbs <= 0 or (seqs // dp) % fmbs):
        raise ValueError(f"algo.forward_micro_batch_size_per_gpu={fmbs} (per GPU) must divide the "
                         f"sequences per DP rank data.prompts_per_step x rollout.n / DP = "
                         f"{seqs} / {dp} = {seqs // dp}")
    if a.ppo_mini_batch_size % dp or (a.ppo_mini_batch_size // dp) % mbs:
        raise ValueError(f"algo.micro_batch_size_per_gpu={mbs} (per GPU) must divide the "
                         f"mini-batch per DP rank algo.ppo_mini_batch_size / DP = "
                         f"{a.ppo_mini_batch_size} / {dp} (ppo_mini_batch_size is global)")
    for name in ("actor_optim", "critic_optim"):
        _one_of(f"{name}.lr_decay_style", getattr(cfg, name).lr_decay_style,
                {"constant", "linear", "cosine"})
    _one_of("trainer.precision", cfg.trainer.precision, {"fp32", "bf16"})
    _positive("trainer.total_steps", cfg.trainer.total_steps)
    if cfg.trainer.time_budget_s < 0:
        raise ValueError(f"trainer.time_budget_s={cfg.trainer.time_budget_s} must be >= 0 "
                         "(0: no limit)")
    if cfg.trainer.gc_interval < 0:
        raise ValueError(f"trainer.gc_interval={cfg.trainer.gc_interval} must be >= 0 "
                         "(0: Python's automatic GC)")


def _validate_recipes(cfg: Config) -> None:
    """Loss aggregation, clip ranges, TIS, dynamic sampling and overlong shaping (DAPO, GSPO, Dr.GRPO)."""
    from hybridflow.algo import AGG_MODES

    a, r = cfg.algo, cfg.rollout
    _one_of("algo.loss_agg_mode", a.loss_agg_mode, set(AGG_MODES))
    if a.loss_scale_factor is not None and a.loss_scale_factor <= 0:
        raise ValueError(f"algo.loss_scale_factor={a.loss_scale_factor} must be > 0 (the constant "
                         f"normaliser of seq-mean-token-sum-norm) or null (rollout.max_new_tokens)")
    if not 0.0 <= a.clip_ratio_low < 1.0:
        raise ValueError(f"algo.clip_ratio_low={a.clip_ratio_low} must be in [0, 1): the ratio's "
                         f"lower bound is 1 - clip_ratio_low")
    if a.clip_ratio_high < 0:
        raise ValueError(f"algo.clip_ratio_high={a.clip_ratio_high} must be >= 0")
    if a.tis_imp_ratio_cap is not None:
        if a.tis_imp_ratio_cap <= 0:
            raise ValueError(f"algo.tis_imp_ratio_cap={a.tis_imp_ratio_cap} must be > 0 (e.g. 2.0) "
                             f"or null (TIS off)")
        if not r.return_logprobs:
            raise ValueError("algo.tis_imp_ratio_cap is set: TIS weighs by pi_old / pi_rollout and "
                             "needs the generator's log-probs; set rollout.return_logprobs=true")
    ds = a.dynamic_sampling
    if ds.enable:
        _positive("algo.dynamic_sampling.max_rounds", ds.max_rounds)
        if r.n < 2:
            raise ValueError(f"algo.dynamic_sampling.enable=true keeps prompts whose samples score "
                             f"differently: set rollout.n >= 2 (got {r.n})")
    ob = cfg.reward.overlong_buffer
    if ob.enable:
        if not 0 < ob.len < r.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer.len={ob.len} must be in (0, rollout.max_new_tokens="
                             f"{r.max_new_tokens}): the penalty ramps over the last `len` tokens "
                             f"(DAPO: 4096 of 20480)")
        if ob.penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")


def load_config(overrides: list[str], *, config_name: str = "ppo") -> Config:
    """Compose conf/<config_name>.yaml with Hydra overrides and type it against `Config`.

    Raises ValueError with a one-line message for unknown keys, bad values or bad override syntax.
    """
    from hydra import compose, initialize_config_module
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ConfigStore.instance().store(name="hybridflow_schema", node=Config)  # conf/ppo.yaml's base
    try:
        with initialize_config_module(config_module=CONF_PACKAGE, version_base=None):
            raw = compose(config_name=config_name, overrides=list(overrides))
        schema = OmegaConf.structured(Config)
        merged = OmegaConf.merge(schema, raw)
        cfg = OmegaConf.to_object(merged)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_one_line(e)) from None
    return cfg


_NOISE = ("object_type", "reference_type", "To append", "Config search path", "provider=")


def _one_line(e: BaseException) -> str:
    """Hydra/OmegaConf errors span several lines and causes; keep the lines that name the problem."""
    lines = []
    while e is not None:
        lines += [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        e = e.__cause__
    keep = [ln for ln in lines if not ln.startswith(_NOISE)]
    return "invalid config: " + " ".join(keep)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
