"""The cost model with critic LoRA and actor.offload_params: the critic's trained parameters equal
what the engine builds; the critic component shrinks to adapters + head; offloaded weights vanish
from exactly the phases the trainer moves them out of (the critic's, a reference model's, and
generation when the generator owns its matrices); the PCIe copies are timed; "will it fit" names
offload_params where it is what makes a config fit."""

import pytest

from hybridflow.config import LoRAConfig, ModelConfig, OptimConfig, ParallelConfig

GIB = 2 ** 30
MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, vocab_size=50)
SEVEN_B = dict(model="qwen2_7b", gpu="H200", prompts_per_step=8, samples_per_prompt=8,
               prompt_len=128, response_len=256, micro_batch_tokens=4 * 384)


def test_critic_trained_params_match_the_engine(single_rank_ctx):
    from hybridflow.cost.memory import critic_trained_params
    from hybridflow.cost.workload import Workload
    from hybridflow.engine import Engine

    eng = Engine(role="critic", model_cfg=MODEL, ctx=single_rank_ctx, parallel=ParallelConfig(),
                 precision="fp32", optim=OptimConfig(), lora=LoRAConfig(rank=4))
    trained = sum(p.numel() for p in eng.module.parameters() if p.requires_grad)
    assert trained == critic_trained_params(MODEL, Workload(algorithm="ppo", critic_lora_rank=4))
    assert trained == eng.num_adapter_params + MODEL.hidden_size + 1


def _phases(**kw):
    from hybridflow.cost.estimate import estimate_memory

    return estimate_memory(num_gpus=kw.pop("num_gpus", 1), layout=kw.pop("layout", {"tp": 1}),
                           **SEVEN_B, **kw).phases_gib


def test_critic_lora_shrinks_the_critic():
    from hybridflow.cost.memory import lora_params
    from hybridflow.cost.shapes import load_shape

    shape = load_shape("qwen2_7b")
    full = _phases(algorithm="ppo")["values"]["critic"]
    lora = _phases(algorithm="ppo", critic_lora_rank=16)["values"]["critic"]
    trained = lora_params(shape, 16) + shape.hidden_size + 1
    pc = shape.num_critic_params  # bf16 weights + fp32 grads + 12 bytes of Adam, each trained
    want = (2 * (pc + trained) + 16 * trained) / (18 * pc)  # (the calibration's scale cancels)
    assert lora / full == pytest.approx(want, rel=1e-9) and full > 5 * lora


def test_offloaded_weights_leave_the_right_phases():
    from hybridflow.cost.shapes import load_shape

    from hybridflow.cost.efficiency import shipped_calibration

    shape = load_shape("qwen2_7b")  # (phases in GiB times the calibration's memory scale)
    matrices = 2 * shape.num_layers * shape.layer_matmul_params / GIB \
        * shipped_calibration().memory_scale
    ppo = dict(algorithm="ppo", use_reference=True)
    off, on = _phases(**ppo), _phases(**ppo, offload_params=True)
    for phase in ("ref", "values", "update_critic"):
        assert on[phase]["actor_weights"] == 0 < off[phase]["actor_weights"]
    for phase in ("gen", "update_actor"):  # in place: generation reads them
        assert on[phase] == off[phase]
    lora = _phases(**ppo, lora_rank=16, offload_params=True)
    assert 0 < lora["values"]["actor_weights"] < 0.1  # the adapters stay
    assert lora["ref"]["actor_weights"] > 14  # the LoRA reference is the actor's base
    fp8_off = _phases(rollout_quantization="fp8")["gen"]
    fp8_on = _phases(rollout_quantization="fp8", offload_params=True)["gen"]
    assert fp8_off["rollout_weights"] == fp8_on["rollout_weights"] == pytest.approx(matrices / 2)
    assert fp8_off["actor_weights"] - fp8_on["actor_weights"] == pytest.approx(matrices)
    # resharded (TP 2 -> 1): the training shard leaves; the buffer holds the whole gen shard
    # either way (the Resharder copies the rank's own slice in), so the step saves the shard
    layout = {"tp": 2, "tp_gen": 1}
    rs_off = _phases(num_gpus=2, layout=layout)["gen"]
    rs_on = _phases(num_gpus=2, layout=layout, offload_params=True)["gen"]
    assert rs_on["actor_weights"] == 0
    assert rs_on["reshard_buffer"] == rs_off["reshard_buffer"] > rs_off["actor_weights"]
    assert sum(rs_off.values()) - sum(rs_on.values()) == pytest.approx(rs_off["actor_weights"])


def test_copies_are_timed_and_fit_is_named():
    from hybridflow.cost.estimate import estimate_cost

    base = dict(layout={"tp": 1}, num_gpus=1, **SEVEN_B)
    # GRPO without a reference, generation in place: nothing leaves, nothing is copied
    in_place = estimate_cost(**base, use_reference=False, offload_params=True)
    assert in_place.time_breakdown == estimate_cost(**base, use_reference=False).time_breakdown
    ref = estimate_cost(**base, offload_params=True).time_breakdown  # a reference model's pass
    assert ref["ref"]["pcie"] > 0
    ppo = estimate_cost(**base, algorithm="ppo", offload_params=True).time_breakdown
    # one stretch away from the ref pass to the actor's update: out once, back once
    assert ppo["ref"]["pcie"] == ppo["update_actor"]["pcie"] > 0 and "pcie" not in ppo["values"]
    lora = estimate_cost(**base, algorithm="ppo", lora_rank=16, offload_params=True).time_breakdown
    # the LoRA reference reads the base; a frozen base is copied out once per run, not per step
    assert "pcie" not in lora["values"] and lora["update_actor"]["pcie"] > 0
    # GRPO, LoRA, optimizer offload, fp8 rollout on 24 GiB: the bf16 matrices beside the codes
    # do not fit; moving them to the host does
    r = estimate_cost(model="qwen2_7b", num_gpus=1, gpu_memory_gib=24, prompts_per_step=4,
                      samples_per_prompt=8, prompt_len=128, response_len=256,
                      micro_batch_tokens=384, lora_rank=16, offload_optimizer=True,
                      rollout_quantization="fp8")
    assert not r.fits
    assert any("parameter offload (actor.offload_params=true)" in s for s in r.suggestions), \
        r.suggestions
