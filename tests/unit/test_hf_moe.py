"""Qwen3-MoE (model.moe) on one rank against transformers' Qwen3MoeForCausalLM (random tiny model,
8 experts, top-2 renormalised): config.json in and out, logits, export round trip, greedy
generation of the in-place decoder, its two MoE paths, and the MoE config checks."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from hybridflow.config import ModelConfig, load_config  # noqa: E402
from hybridflow.config_checks import validate  # noqa: E402
from hybridflow.model_config import MoEConfig  # noqa: E402
from hybridflow.models.build import build_model  # noqa: E402
from hybridflow.models.hf import (hf_to_megatron_state_dict, load_hf_weights,  # noqa: E402
                                  megatron_to_hf_state_dict, read_hf_config, save_hf_checkpoint)
from hybridflow.rollout import moe as rmoe  # noqa: E402
from tests.hf_models import hf_logits, make_checkpoint, single_rank_megatron  # noqa: E402

IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
POS = torch.arange(IDS.shape[1]).expand_as(IDS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("hf") / "moe"))


def files(d):
    return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(d, f)).items()}


def test_read_config(ckpt):
    cfg = read_hf_config(ckpt)
    assert cfg.moe == MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=32,
                                norm_topk_prob=True, aux_loss_coeff=0.001)
    assert cfg.qk_layernorm and cfg.hf_architecture == "Qwen3MoeForCausalLM"
    # counts: router + 8 experts held, router + 2 experts per token
    h = cfg.hidden_size
    assert cfg.mlp_params == h * 8 + 3 * h * 32 * 8
    assert cfg.mlp_matmul_params == h * 8 + 3 * h * 32 * 2


def test_logits_and_round_trip(ckpt, tmp_path):
    cfg = read_hf_config(ckpt)
    with single_rank_megatron() as ctx:
        model = build_model(cfg, role="actor", ctx=ctx).eval()
        load_hf_weights(model, ckpt, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        with torch.no_grad():
            ours = model(IDS, POS, attention_mask=None)[..., :cfg.vocab_size]
        torch.testing.assert_close(ours, hf_logits(ckpt, IDS), atol=1e-4, rtol=1e-4)
        full = {n: p.detach() for n, p in model.named_parameters()}
    original = files(ckpt)
    assert megatron_to_hf_state_dict(hf_to_megatron_state_dict(original, cfg), cfg).keys() == \
        original.keys()
    save_hf_checkpoint(str(tmp_path / "out"), full, cfg)
    exported = files(str(tmp_path / "out"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    written = json.load(open(tmp_path / "out" / "config.json"))
    assert written["model_type"] == "qwen3_moe" and written["num_experts"] == 8
    assert read_hf_config(str(tmp_path / "out")).moe == cfg.moe


def test_generation_equals_transformers_greedy(ckpt):
    from transformers import AutoModelForCausalLM

    from hybridflow.config import RolloutConfig
    from hybridflow.rollout import Generator

    cfg = read_hf_config(ckpt)
    gen = Generator(model_cfg=cfg, params=hf_to_megatron_state_dict(files(ckpt), cfg),
                    tp_group=None, device=torch.device("cpu"), dtype=torch.float32,
                    true_vocab_size=cfg.vocab_size)
    prompts = [[3, 17, 99, 5], [42], [7, 8, 9, 10, 11, 12, 13]]
    out = gen.generate(prompts, cfg=RolloutConfig(max_new_tokens=8, temperature=0.0),
                       eos_id=-1, pad_id=0, seed=0)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager",
                                               dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert out.response_ids[i].tolist() == want.tolist(), i


def test_dense_and_sparse_moe_paths_agree(ckpt):
    """The CUDA-graph-safe path (every expert, routing weight 0 where not chosen) and the grouped
    one give transformers' MoE block output."""
    from transformers import AutoModelForCausalLM

    cfg = read_hf_config(ckpt)
    params = hf_to_megatron_state_dict(files(ckpt), cfg)
    m = rmoe.load_moe(cfg, params, "decoder.layers.1.", tp=1, get=lambda p, n, s: p[n],
                      conv=lambda t: t)
    h = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    block = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).model.layers[1].mlp
    with torch.no_grad():
        want = block(h[None])[0]
    torch.testing.assert_close(rmoe.sparse(h, m), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rmoe.dense(h, m), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, match", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_config_json_rules(ckpt, tmp_path, change, match):
    c = json.load(open(os.path.join(ckpt, "config.json")))
    c.update(change)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=match):
        read_hf_config(str(tmp_path))


MOE = ["model=tiny", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.moe_ffn_hidden_size=32", "data.synthetic=copy"]


@pytest.mark.parametrize("extra, world, match", [
    (["parallel.expert_parallel_size=3"], 3, "must divide model.moe.num_experts"),
    (["parallel.tensor_parallel_size=2"], 2, "sequence_parallel"),
    (["model.moe.top_k=5"], 1, "model.moe.top_k"),
    (["model.moe.token_dispatcher=flex"], 1, "model.moe.token_dispatcher"),
    (["parallel.expert_parallel_size=4"], 2, "ranks of a pipeline stage"),
    (["parallel.expert_parallel_size=2", "algo.use_dynamic_bsz=true"], 2, "use_dynamic_bsz"),
    (["rollout.tensor_parallel_size=1", "parallel.tensor_parallel_size=2",
      "parallel.sequence_parallel=true"], 2, "generates in place"),
])
def test_moe_config_checks(extra, world, match):
    with pytest.raises(ValueError, match=match):
        validate(load_config(MOE + extra), world_size=world)


def test_auto_turns_token_budgets_off_under_ep():
    from hybridflow.config_auto import resolve_auto

    cfg, notes = resolve_auto(load_config(MOE + ["parallel.expert_parallel_size=2"]),
                              device_type="cpu")
    assert cfg.algo.use_dynamic_bsz is False
    cfg, _ = resolve_auto(load_config(MOE), device_type="cpu")
    validate(cfg, world_size=1)


def test_moe_config_accepted_and_dense_ep_refused():
    validate(load_config(MOE + ["parallel.expert_parallel_size=2"]), world_size=2)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        validate(load_config(["model=tiny", "data.synthetic=copy",
                              "parallel.expert_parallel_size=2"]), world_size=2)
    assert ModelConfig(moe={"num_experts": 2, "top_k": 1}).moe.num_experts == 2


def test_checkpoint_stacked_experts_split_per_expert():
    """dist_checkpointing stores an MoE layer's experts stacked (layers, experts, ...) whatever the
    saving EP; the full-weights reader (export) gives one tensor per expert under global names."""
    from hybridflow.checkpoint.full import _canonical_names

    cfg = ModelConfig(num_layers=2, moe=MoEConfig(num_experts=3, top_k=1, moe_ffn_hidden_size=4))
    fc1 = torch.randn(2, 3, 8, 6)
    out = _canonical_names({"decoder.layers.mlp.experts.experts.linear_fc1.weight": fc1,
                            "decoder.layers.mlp.router.weight": torch.randn(2, 3, 6)}, cfg)
    assert sorted(out) == sorted(
        [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"
         for i in range(2) for e in range(3)] + [f"decoder.layers.{i}.mlp.router.weight"
                                                 for i in range(2)])
    assert torch.equal(out["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"],
                       fc1[1, 2])
