"""The auto (null) defaults: fast on a GPU, exact and simple on CPU, a user's value kept, and token
budgets sized from free memory with the cost model's estimate."""
import pytest

from hybridflow.config import load_config
from hybridflow.config_auto import budgets_unset, resolve_auto, size_token_budgets
from hybridflow.config_checks import validate

GPU_JOB = ["model=qwen2_0_5b", "algo=grpo", "data.synthetic=copy", "data.max_prompt_length=128",
           "data.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=256",
           "algo.ppo_mini_batch_size=64"]


def _cfg(*overrides, world_size=1):
    cfg = load_config(list(overrides))
    validate(cfg, world_size=world_size)
    return cfg


def test_no_experiment_by_default_and_a_clear_error():
    cfg = load_config([])
    assert cfg.data.synthetic is None and cfg.data.train_files is None
    with pytest.raises(ValueError, match=r"experiment=<name>.*demo is the CPU demo"):
        validate(cfg, world_size=1)


@pytest.mark.parametrize("device, precision, dynamic, rollout, unset", [
    # CPU stays exact and simple
    ("cpu", "fp32", (False, False), (True, False, 0, False), False),
    # a GPU gets the fast path; the 384-column cache: an eighth, at least 64 columns
    ("cuda", "bf16", (True, True), (False, True, 64, True), True),
])
def test_auto_per_device(device, precision, dynamic, rollout, unset):
    cfg, notes = resolve_auto(_cfg(*GPU_JOB), device_type=device)
    assert cfg.trainer.precision == precision
    assert (cfg.algo.use_dynamic_bsz, cfg.algo.pack_sequences) == dynamic
    r = cfg.rollout
    assert (r.free_cache_engine, r.compact_finished_rows, r.decode_kv_window, r.compile_decode) == \
        rollout
    assert notes == [] and budgets_unset(cfg) == unset
    assert r.kernel_options.prefill_width_multiple == (64 if device == "cuda" else 1)
    if device == "cpu":
        validate(cfg, world_size=1)


@pytest.mark.parametrize("overrides, device, on, note", [
    ((), "cuda", True, None),
    ((), "cpu", False, None),  # on CPU a pass has finished when its last op returns
    (("reward.launch_reward_fn_async=true",), "cuda", False, None),  # the user's choice
    (("reward.score_in_pass=false",), "cuda", False, None),
    (("rollout.partial.enable=true", "rollout.return_logprobs=true",
      "rollout.partial.max_decode_steps=128"), "cuda", False, "rollout.partial.enable=true"),
    (("reward.model_path=/rm",), "cuda", False, "reward.model_path is set"),
])
def test_reward_scored_in_the_pass_where_it_applies(overrides, device, on, note):
    """reward.score_in_pass auto: on with a GPU unless the step needs the scores first (partial
    rollouts, dynamic sampling), the reward is a model's, or the thread option is set."""
    cfg, notes = resolve_auto(_cfg(*GPU_JOB, *overrides), device_type=device)
    assert cfg.reward.score_in_pass is on
    assert [n for n in notes if "score_in_pass" in n] == (
        [] if note is None else [next(n for n in notes if note in n)])
    validate(cfg, world_size=1)


def test_multi_turn_gets_graphs_and_windows_on_a_gpu():
    """Multi-turn replays a CUDA graph of its own step with KV windows and compaction; compile
    stays off for it (validate would refuse it)."""
    cfg, notes = resolve_auto(_cfg(*GPU_JOB, "rollout.multi_turn.enable=true",
                                   "rollout.multi_turn.tool_config_path=calculator.yaml"),
                              device_type="cuda")
    r = cfg.rollout
    assert (r.cuda_graphs, r.decode_kv_window, r.compact_finished_rows, r.compile_decode) == \
        (True, 64, True, False)
    assert notes == []
    validate(cfg, world_size=1)


def test_user_values_are_kept():
    cfg, _ = resolve_auto(_cfg(*GPU_JOB, "trainer.precision=fp32", "algo.use_dynamic_bsz=false",
                               "rollout.free_cache_engine=true", "rollout.decode_kv_window=0",
                               "rollout.compile_decode=false",
                               "rollout.kernel_options.prefill_width_multiple=1",
                               "reward.score_in_pass=false"), device_type="cuda")
    assert cfg.trainer.precision == "fp32" and cfg.algo.use_dynamic_bsz is False
    assert (cfg.rollout.free_cache_engine, cfg.rollout.decode_kv_window,
            cfg.rollout.compile_decode) == (True, 0, False)
    assert cfg.rollout.kernel_options.prefill_width_multiple == 1
    assert cfg.reward.score_in_pass is False


def test_gpu_fallbacks_say_why():
    cfg, notes = resolve_auto(_cfg(*GPU_JOB, "parallel.pipeline_parallel_size=2",
                                   "parallel.tensor_parallel_size=2", "rollout.tensor_parallel_size=1",
                                   world_size=4), device_type="cuda")
    assert cfg.algo.use_dynamic_bsz is False and cfg.rollout.free_cache_engine is True
    text = "\n".join(notes)
    assert "algo.use_dynamic_bsz=false" in text and "rollout.free_cache_engine=true" in text
    assert all(n.startswith("auto: ") for n in notes)


def test_pack_asked_for_turns_budgets_on_cpu():
    cfg, _ = resolve_auto(_cfg(*GPU_JOB, "algo.pack_sequences=true"), device_type="cpu")
    assert cfg.algo.use_dynamic_bsz is True and cfg.algo.max_tokens_per_micro_batch_per_gpu == 16384
    validate(cfg, world_size=1)


def test_budgets_one_micro_batch_when_memory_is_plenty():
    cfg, _ = resolve_auto(_cfg(*GPU_JOB), device_type="cuda")
    sized, line = size_token_budgets(cfg, world_size=1, free_gib=139.0)
    a = sized.algo
    assert a.max_tokens_per_micro_batch_per_gpu == 64 * 384  # the whole mini-batch
    assert a.forward_max_tokens_per_micro_batch_per_gpu == 64 * 384
    assert "24576" in line
    validate(sized, world_size=1)


def test_budgets_shrink_with_memory_and_keep_a_set_value():
    cfg, _ = resolve_auto(_cfg(*GPU_JOB, "model=qwen2_1_5b", "data.prompts_per_step=64",
                               "algo.ppo_mini_batch_size=512", "rollout.max_new_tokens=1024"),
                          device_type="cuda")
    big = size_token_budgets(cfg, world_size=1, free_gib=139.0)[0].algo
    small = size_token_budgets(cfg, world_size=1, free_gib=40.0)[0].algo
    row = 128 + 1024
    for a in (big, small):
        for v in (a.max_tokens_per_micro_batch_per_gpu, a.forward_max_tokens_per_micro_batch_per_gpu):
            assert v % row == 0 and row <= v <= 512 * row
    assert small.max_tokens_per_micro_batch_per_gpu < big.max_tokens_per_micro_batch_per_gpu
    # forward-only passes keep no activations for backward: a budget at least the update's
    assert big.forward_max_tokens_per_micro_batch_per_gpu >= big.max_tokens_per_micro_batch_per_gpu
    kept = size_token_budgets(
        resolve_auto(_cfg(*GPU_JOB, "algo.max_tokens_per_micro_batch_per_gpu=4096"),
                     device_type="cuda")[0], world_size=1, free_gib=139.0)[0].algo
    assert kept.max_tokens_per_micro_batch_per_gpu == 4096


def test_budgets_leave_room_for_the_update_graphs_pools():
    """With parallel.train_cuda_graphs the update graphs keep one micro-batch's activations
    reserved through generation and the forward passes: the budgets chosen keep every phase,
    pools included, within the share of the memory they are sized for; the training budget no
    larger and the forward one smaller than without graphs."""
    from dataclasses import replace

    from hybridflow.config_auto import MEMORY_SHARE
    from hybridflow.cost.efficiency import shipped_calibration
    from hybridflow.cost.from_config import plan_for, workload_fields
    from hybridflow.cost.gpus import get_gpu
    from hybridflow.cost.memory import memory_for
    from hybridflow.cost.workload import Workload

    job = ("experiment=gsm8k_qwen_coder_0_5b", "actor.lora.rank=32", "actor.lora.alpha=64",
           "algo.max_tokens_per_micro_batch_per_gpu=null",
           "algo.forward_max_tokens_per_micro_batch_per_gpu=null")
    calib, free = shipped_calibration(), 60.0
    sized = {}
    for graphs in (False, True):
        cfg, _ = resolve_auto(_cfg(*job, f"parallel.train_cuda_graphs={str(graphs).lower()}"),
                              device_type="cuda")
        cfg = size_token_budgets(cfg, world_size=1, free_gib=free)[0]
        est = memory_for(cfg.model, replace(get_gpu("H200"), memory_gib=free), plan_for(cfg, 1),
                         Workload(**workload_fields(cfg, decode_kernels="triton")), calib)
        share = MEMORY_SHARE * est.capacity_gib
        assert max(est.reserved_phases_gib.values()) <= share
        assert (est.reserved_peak_gib > est.peak_gib) is graphs
        sized[graphs] = cfg.algo
    assert sized[False].max_tokens_per_micro_batch_per_gpu == 21 * 1280
    assert sized[True].max_tokens_per_micro_batch_per_gpu <= 21 * 1280
    assert sized[True].forward_max_tokens_per_micro_batch_per_gpu < \
        sized[False].forward_max_tokens_per_micro_batch_per_gpu


def test_gpu_template_names_what_is_missing():
    with pytest.raises(ValueError, match=r"HYBRIDFLOW_MODEL.*model.hf_path"):
        load_config(["experiment=gpu_template"])
    cfg = load_config(["experiment=gpu_template", "model.hf_path=/models/m", "data.train_files=t.jsonl",
                       "data.val_files=v.jsonl"])
    validate(cfg, world_size=8)
    assert cfg.algo.use_dynamic_bsz is None and cfg.trainer.precision == "auto"  # speed left to auto


def test_generator_freed_where_keeping_it_starves_the_update():
    """rollout.free_cache_engine left null (in place on a GPU: kept) is turned true where the kept
    KV cache would leave the update less than half the training budget it gets freed (Qwen2-7B
    LoRA with recompute under 24 GiB: 416 against 2,496 tokens), with a line that says so; kept
    at 48 GiB (4,160 against 4,576), where the user set it, and where the budgets are set."""
    from hybridflow.config_auto import size_for_memory

    job = ("model=qwen2_7b", "algo=grpo", "rollout.n=8", "data.synthetic=copy",
           "data.max_prompt_length=160",
           "data.prompts_per_step=8", "rollout.max_new_tokens=256", "rollout.ignore_eos=true",
           "algo.ppo_mini_batch_size=64", "actor.lora.rank=16", "actor.lora.alpha=32",
           "parallel.activation_checkpointing=true")

    def sized(*extra, free_gib):
        raw = _cfg(*job, *extra)
        cfg, _ = resolve_auto(raw, device_type="cuda")
        return size_for_memory(cfg, asked=raw.rollout, world_size=1, free_gib=free_gib)

    cfg, lines = sized(free_gib=24.0)
    assert cfg.rollout.free_cache_engine is True
    assert cfg.algo.max_tokens_per_micro_batch_per_gpu == 2496
    assert "rollout.free_cache_engine=true" in lines[0] and "416-token" in lines[0]
    cfg, lines = sized(free_gib=48.0)
    assert cfg.rollout.free_cache_engine is False and len(lines) == 1
    cfg, _ = sized("rollout.free_cache_engine=false", free_gib=24.0)
    assert cfg.rollout.free_cache_engine is False
    assert cfg.algo.max_tokens_per_micro_batch_per_gpu == 416
    cfg, _ = sized("algo.max_tokens_per_micro_batch_per_gpu=416", free_gib=24.0)
    assert cfg.rollout.free_cache_engine is False


@pytest.mark.parametrize("extra, graphs, note", [
    ((), False, None),  # full-parameter training: eager
    (("actor.lora.rank=16",), True, None),  # a LoRA update replays as graphs
    (("actor.lora.rank=16", "parallel.activation_checkpointing=true"), False,
     "parallel.activation_checkpointing=true"),
    (("actor.lora.rank=16", "actor.lora.dropout=0.05"), False, "actor.lora.dropout=0.05"),
    (("actor.lora.rank=16", "actor.offload_params=true"), False, "actor.offload_params=true"),
    (("actor.lora.rank=16", "parallel.tensor_parallel_size=2"), False,
     "parallel.tensor_parallel_size > 1"),
    (("actor.lora.rank=16", "actor.lora.target_modules=[q_proj,v_proj]", "model=qwen3_moe_2b",
      "parallel.sequence_parallel=false"), False, "a mixture-of-experts model"),
    (("actor.lora.rank=16", "parallel.train_cuda_graphs=false"), False, None),  # the user's value
    (("parallel.train_cuda_graphs=true",), True, None),
])
def test_update_graphs_on_for_a_lora_update_on_a_gpu(extra, graphs, note):
    ws = 2 if "parallel.tensor_parallel_size=2" in extra else 1
    cfg, notes = resolve_auto(_cfg(*GPU_JOB, *extra, world_size=ws), device_type="cuda")
    assert cfg.parallel.train_cuda_graphs is graphs
    lines = [n for n in notes if "train_cuda_graphs" in n]
    assert (lines == []) if note is None else (len(lines) == 1 and note in lines[0])
    validate(cfg, world_size=ws)
    on_cpu, _ = resolve_auto(_cfg(*GPU_JOB, *extra, world_size=ws), device_type="cpu")
    assert on_cpu.parallel.train_cuda_graphs is ("parallel.train_cuda_graphs=true" in extra)


def test_update_graphs_stay_off_with_a_full_parameter_critic():
    """PPO with a LoRA actor and a full critic: the critic's update would be graphed too, where
    the padding costs what the host saves; with a LoRA critic both replay."""
    ppo = ["model=qwen2_0_5b", "algo=ppo", "data.synthetic=copy", "actor.lora.rank=16"]
    assert resolve_auto(_cfg(*ppo), device_type="cuda")[0].parallel.train_cuda_graphs is False
    cfg, _ = resolve_auto(_cfg(*ppo, "critic.lora.rank=16"), device_type="cuda")
    assert cfg.parallel.train_cuda_graphs is True


def test_a_freed_generator_gets_no_kv_windows():
    """Each KV window is a decode graph; a generator freed after generation captures them again
    every step, so the auto window is 0 for it (a user's window is kept), and the budgets' own
    choice to free the generator takes an auto window with it."""
    from hybridflow.config_auto import FREED_WINDOW_NOTE, size_for_memory

    cfg, notes = resolve_auto(_cfg(*GPU_JOB, "rollout.free_cache_engine=true"), device_type="cuda")
    assert cfg.rollout.decode_kv_window == 0 and FREED_WINDOW_NOTE in notes
    cfg, notes = resolve_auto(_cfg(*GPU_JOB, "rollout.free_cache_engine=true",
                                   "rollout.decode_kv_window=128"), device_type="cuda")
    assert cfg.rollout.decode_kv_window == 128 and FREED_WINDOW_NOTE not in notes
    # Qwen2-7B LoRA + recompute under 24 GiB: keeping the generator would starve the update
    job = ["model=qwen2_7b", "algo=grpo", "data.synthetic=copy", "data.max_prompt_length=160",
           "data.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=256",
           "algo.ppo_mini_batch_size=64", "actor.lora.rank=16", "actor.lora.alpha=32",
           "parallel.activation_checkpointing=true"]
    for window, want in ((None, 0), (64, 64)):
        extra = [] if window is None else [f"rollout.decode_kv_window={window}"]
        raw = _cfg(*job, *extra)
        kept, _ = resolve_auto(raw, device_type="cuda")
        assert kept.rollout.free_cache_engine is False and kept.rollout.decode_kv_window == 64
        sized, lines = size_for_memory(kept, asked=raw.rollout, world_size=1, free_gib=24.0)
        assert sized.rollout.free_cache_engine is True
        assert sized.rollout.decode_kv_window == want
        assert (FREED_WINDOW_NOTE in lines) is (window is None)


@pytest.mark.parametrize("extra, on", [
    ((), True),  # a single-turn bf16 rollout, graphed, generator kept, Triton layers
    (("rollout.speculative.enable=false",), False),  # the user's value
    (("rollout.free_cache_engine=true",), False),  # its tail graphs would be captured every step
    (("rollout.cuda_graphs=false",), False),
    (("rollout.decode_kernels=torch",), False),  # the PyTorch fallback: not shown to pay
    (("rollout.kv_cache_dtype=fp8",), False),
    (("rollout.quantization=fp8",), False),  # refused with it when asked for
    (("model=qwen3_0_6b",), False),  # q/k norms: the PyTorch fallback
    (("rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=calculator.yaml"),
     False),
])
def test_speculative_tail_on_where_it_runs_the_decode_layers(extra, on):
    cfg, _ = resolve_auto(_cfg(*GPU_JOB, *extra), device_type="cuda")
    assert cfg.rollout.speculative.enable is on
    validate(cfg, world_size=1)
    on_cpu, _ = resolve_auto(_cfg(*GPU_JOB, *extra), device_type="cpu")
    assert on_cpu.rollout.speculative.enable is False


def test_speculative_tail_goes_with_a_generator_the_budgets_free():
    from hybridflow.config_auto import size_for_memory

    job = ["model=qwen2_7b", "algo=grpo", "data.synthetic=copy", "data.max_prompt_length=160",
           "data.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=256",
           "algo.ppo_mini_batch_size=64", "actor.lora.rank=16", "actor.lora.alpha=32",
           "parallel.activation_checkpointing=true"]
    for asked, want in ((None, False), (True, True)):
        extra = [] if asked is None else ["rollout.speculative.enable=true"]
        raw = _cfg(*job, *extra)
        kept, _ = resolve_auto(raw, device_type="cuda")
        assert kept.rollout.speculative.enable is True
        sized, _ = size_for_memory(kept, asked=raw.rollout, world_size=1, free_gib=24.0)
        assert sized.rollout.free_cache_engine is True
        assert sized.rollout.speculative.enable is want
