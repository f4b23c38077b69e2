"""Qwen3-MoE on 2 gloo ranks against transformers' Qwen3MoeForCausalLM (random tiny model):
logits and every gradient at EP=1 (DP=2), EP=2, TP=2 + SP (expert TP=2) and TP=2 + EP=2 (expert
TP=1), each rank loading only its experts / shards from the HF checkpoint; the gathered weights
export bit-identically (benchmarks/qwen3_moe_parity.py, at a smaller shape)."""

import importlib.util
import os

import pytest

pytest.importorskip("transformers")

from tests.dist.launcher import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parity(out, layouts):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "qwen3_moe_parity", os.path.join(ROOT, "benchmarks", "qwen3_moe_parity.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(["--out", out, "--hidden", "64", "--layers", "2", "--heads", "4",
                     "--kv-heads", "2", "--head-dim", "16", "--vocab", "120", "--seq", "8",
                     "--expert-ffn", "32", "--layouts", layouts])


# the slow tier: the default tier loads HF weights at EP=2 in the generation test below and trains
# at EP=2 through the Engine in test_moe_engine.py
@pytest.mark.slow
@pytest.mark.parametrize("layouts", ["ep1,ep2,tp2,tp2_ep2"])
def test_moe_parity(tmp_path, layouts):
    record = run_ranks(_parity, 2, str(tmp_path / "parity.json"), layouts)[0]
    rows = {r["layout"]: r for r in record["layouts"]}
    assert set(rows) == set(layouts.split(","))
    for name, r in rows.items():
        assert r["max_abs_logit_diff"] < 1e-4 * max(1.0, r["max_abs_logit"]), (name, r)
        assert r["max_abs_grad_diff"] < 1e-5 * max(1.0, r["max_abs_grad"]) + 1e-4, (name, r)
        assert r["export_bit_identical"] is True, name
    assert rows["ep2"]["ep"] == 2


def _generate(path, prompts, ep, tp):
    """Greedy tokens of the in-place generator over the training model's parameters at EP=`ep`,
    TP=`tp` (2 ranks), experts gathered for generation as the rollout stage does."""
    import torch

    from hybridflow.config import RolloutConfig
    from hybridflow.models.build import build_model
    from hybridflow.models.hf import load_hf_weights, read_hf_config
    from hybridflow.parallel import groups
    from hybridflow.parallel.reshard import generation_params
    from hybridflow.rollout import Generator

    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=0, ep=ep, etp=1 if ep * tp > 2 else None)
    cfg = read_hf_config(path)
    model = build_model(cfg, role="actor", ctx=ctx, sequence_parallel=tp > 1)
    load_hf_weights(model, path, cfg, tp_rank=ctx.train.tp, tp_size=tp, pp_rank=0, pp_size=1,
                    **ctx.expert_coords)
    params = generation_params(dict(model.named_parameters()), ctx, cfg)
    gen = Generator(model_cfg=cfg, params=params, tp_group=ctx.tp_group if tp > 1 else None,
                    device=torch.device("cpu"), dtype=torch.float32,
                    true_vocab_size=cfg.vocab_size)
    with torch.no_grad():
        out = gen.generate(prompts, cfg=RolloutConfig(max_new_tokens=6, temperature=0.0),
                           eos_id=-1, pad_id=0, seed=0)
    # the gathered experts are copies: training's local experts are untouched
    local = [n for n in dict(model.named_parameters()) if ".local_experts." in n]
    return out.response_ids.tolist(), len(local), sum(".local_experts." in n for n in params)


@pytest.mark.parametrize("ep, tp", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_moe_generation_at_ep2_equals_transformers(tmp_path, ep, tp):
    """EP=2 (TP=1: each rank 4 experts; TP=2 + EP=2: each rank 4 whole experts, sliced to its TP
    shard for generation): the gathered generator's greedy tokens are transformers'."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.hf_models import make_checkpoint

    path = make_checkpoint("qwen3_moe", str(tmp_path / "moe"))
    prompts = [[3, 17, 99, 5], [42], [7, 8, 9, 10, 11, 12, 13]]
    results = run_ranks(_generate, 2, path, prompts, ep, tp)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                               dtype=torch.float32).eval()
    for tokens, local, gathered in results:
        assert (local, gathered) == (2 * 2 * 4, 2 * 2 * 8)  # layers x (fc1, fc2) x experts
        for i, p in enumerate(prompts):
            want = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):]
            assert tokens[i] == want.tolist(), (ep, tp, i)
