"""Small cards: the cost model's LoRA parameter count equals the adapters the engine builds, LoRA
and optimizer offload shrink what it predicts (no reference copy, adapter-only grads and state),
"will it fit on 1 x 24 GiB" names what it needs, and trainer.gpu_memory_limit_gib is checked and,
on CPU, ignored with a warning line."""

import dataclasses

import pytest
import torch

from hybridflow.config import LoRAConfig, ModelConfig, OptimConfig, ParallelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)
SEVEN_B = dict(model="qwen2_7b", gpu="H200", num_gpus=1, prompts_per_step=8, samples_per_prompt=8,
               prompt_len=128, response_len=256, micro_batch_tokens=4 * 384)


def test_lora_params_match_the_engine(single_rank_ctx):
    from hybridflow.cost.memory import lora_params
    from hybridflow.engine import Engine

    eng = Engine(role="actor", model_cfg=MODEL, ctx=single_rank_ctx, parallel=ParallelConfig(),
                 precision="fp32", optim=OptimConfig(), lora=LoRAConfig(rank=4))
    assert eng.num_adapter_params == lora_params(MODEL, 4) > 0


def test_lora_and_offload_in_the_memory_model():
    from hybridflow.cost.estimate import estimate_memory
    from hybridflow.cost.memory import lora_params
    from hybridflow.cost.shapes import load_shape

    layout = {"tp": 1}
    full = estimate_memory(layout=layout, **SEVEN_B).phases_gib
    lora = estimate_memory(layout=layout, lora_rank=16, **SEVEN_B).phases_gib
    off = estimate_memory(layout=layout, offload_optimizer=True, **SEVEN_B).phases_gib
    shape = load_shape("qwen2_7b")
    adapters = lora_params(shape, 16)
    assert lora["ref"]["reference"] == 0 and full["ref"]["reference"] > 10
    assert lora["update_actor"]["actor_optimizer"] == pytest.approx(12 * adapters / 2 ** 30,
                                                                    rel=0.2)
    assert lora["update_actor"]["actor_grads"] == pytest.approx(4 * adapters / 2 ** 30, rel=0.2)
    assert off["update_actor"]["actor_optimizer"] == 0
    assert off["optimizer_step"]["actor_optimizer"] == full["update_actor"]["actor_optimizer"]
    grads = estimate_memory(layout=layout, offload_grads=True, **SEVEN_B).phases_gib
    assert grads["gen"]["actor_grads"] == 0 and grads["ref"]["actor_grads"] == 0
    assert grads["update_actor"]["actor_grads"] == full["update_actor"]["actor_grads"] > 20


def test_will_it_fit_names_what_it_needs():
    from hybridflow.cost.estimate import estimate_cost

    r = estimate_cost(gpu_memory_gib=24, **SEVEN_B)
    assert not r.fits
    assert any("fits on 1 x H200@24GiB" in s and "LoRA (actor.lora.rank=16)" in s
               for s in r.suggestions), r.suggestions
    assert estimate_cost(gpu_memory_gib=24, lora_rank=16, **SEVEN_B).fits
    with pytest.raises(ValueError, match="gpu_memory_gib"):
        estimate_cost(gpu_memory_gib=1, **SEVEN_B)


def test_will_it_fit_tries_the_fp8_kv_cache_first():
    """A long-response GRPO step whose kept generator cache decides the peak: on a 24 GiB card the
    fp8 KV cache (with recompute, which the search adds) is what is named, before LoRA or offload,
    and with it the estimate fits."""
    from hybridflow.cost.estimate import estimate_cost

    work = dict(model="qwen2_5_coder_0_5b", gpu="H100", num_gpus=1, prompts_per_step=64,
                samples_per_prompt=8, prompt_len=120, response_len=1024, max_new_tokens=1024,
                keep_generator=True)
    r = estimate_cost(gpu_memory_gib=24, **work)
    assert not r.fits
    line, = [s for s in r.suggestions if s.startswith("fits on")]
    assert "the fp8 KV cache (rollout.kv_cache_dtype=fp8)" in line, line
    assert "LoRA" not in line and "offload" not in line.split(":")[0], line
    assert estimate_cost(gpu_memory_gib=24, kv_cache_dtype="fp8", **work).fits


def test_memory_limit_config():
    from hybridflow.config import load_config
    from hybridflow.config_auto import apply_memory_limit
    from hybridflow.config_checks import validate

    with pytest.raises(ValueError, match="trainer.gpu_memory_limit_gib"):
        validate(load_config(["experiment=demo", "trainer.gpu_memory_limit_gib=0"]), world_size=1)
    cap, line = apply_memory_limit(24, torch.device("cpu"))
    assert cap is None and "ignored" in line and "gpu_memory_limit_gib=24" in line
    assert apply_memory_limit(None, torch.device("cpu")) == (None, None)
