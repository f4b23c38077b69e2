"""Adapter-only LoRA checkpoints: the role dir holds the adapters (and their optimizer state), not
the frozen base; resume re-creates a random-init base from its seed and checks its fingerprint
(another base is refused, or allowed with the override); the old full format still loads."""

import dataclasses
import os

import pytest
import torch

from hybridflow.config import LoRAConfig, ModelConfig, OptimConfig, ParallelConfig
from tests.dist.launcher import run_ranks

MODEL = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                    num_query_groups=2, vocab_size=256)
LORA = LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])


def _engine(tp: int, seed: int):
    from hybridflow.engine import Engine
    from hybridflow.parallel import groups

    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=seed)
    return Engine(role="actor", model_cfg=MODEL, ctx=ctx,
                  parallel=ParallelConfig(tensor_parallel_size=tp), precision="fp32",
                  optim=OptimConfig(lr=1e-3), lora=LORA, seed=seed)


def _lora_dict(eng, seed: int, adapter_only: bool) -> dict:
    from hybridflow.checkpoint.base import base_identity

    return {**dataclasses.asdict(LORA), "base_model": "", "adapter_only": adapter_only,
            "base": base_identity(MODEL, eng.module, seed=seed)}


def _save(roots: dict, seed: int):
    """Spawned rank: a random-init base with nonzero adapters, saved in both formats."""
    from hybridflow.checkpoint import save_checkpoint
    from hybridflow.models.lora import adapters

    eng = _engine(1, seed)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, a in adapters(eng.module):
            for b in a.B.values():
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    eng.optimizer.reload_model_params()
    for fmt, root in roots.items():
        save_checkpoint(root, step=1, models={"actor": [eng.model]},
                        optimizers={"actor": eng.optimizer}, model_configs={"actor": MODEL},
                        adapter_configs={"actor": _lora_dict(eng, seed, fmt == "adapters")})
    return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def _load(root: str, tp: int, seed: int, allow: bool = False):
    from hybridflow.checkpoint import load_checkpoint
    from hybridflow.checkpoint.base import base_identity

    eng = _engine(tp, seed)
    ident = base_identity(MODEL, eng.module, seed=seed)
    try:
        load_checkpoint(root, models={"actor": [eng.model]}, optimizers={"actor": eng.optimizer},
                        model_configs={"actor": MODEL}, base_identities={"actor": ident},
                        allow_base_change=allow)
    except ValueError as e:
        return str(e)
    return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora_ckpt")
    roots = {"adapters": str(base / "adapters"), "full": str(base / "full")}
    return roots, run_ranks(_save, 1, roots, 3)[0]


def test_adapter_only_holds_no_base_and_is_small(saved):
    from megatron.core import dist_checkpointing

    roots, _ = saved
    only = os.path.join(roots["adapters"], "step_1", "actor")
    full = os.path.join(roots["full"], "step_1", "actor")
    keys = list(dist_checkpointing.load_tensors_metadata(only))
    assert keys and all(".lora." in k for k in keys), keys
    assert any(".lora." not in k for k in dist_checkpointing.load_tensors_metadata(full))
    small, big = _dir_bytes(only), _dir_bytes(full)
    assert small * 8 < big, (small, big)


def test_resume_recreates_random_base_bit_exactly(saved):
    roots, want = saved
    got = run_ranks(_load, 1, roots["adapters"], 1, 3)[0]
    assert not isinstance(got, str), got
    assert set(got) == set(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    # Megatron's CPU init draws full matrices: TP=2 re-creates the same base (fingerprint matches)
    assert all(not isinstance(r, str) for r in run_ranks(_load, 2, roots["adapters"], 2, 3)), \
        "TP=2 resume refused"


def test_other_base_is_refused_or_allowed(saved):
    roots, want = saved
    err = run_ranks(_load, 1, roots["adapters"], 1, 4)[0]
    assert isinstance(err, str) and "trainer.seed" in err and "resume_allow_base_change" in err
    assert "trainer.seed=3" in err and "trainer.seed=4" in err
    got = run_ranks(_load, 1, roots["adapters"], 1, 4, True)[0]
    for n, t in want.items():  # the adapters load; the base is this run's (seed 4)
        if ".lora." in n or n.endswith("linear_qkv.weight"):
            assert torch.equal(got[n], t) == (".lora." in n), n


def test_full_format_still_loads(saved):
    roots, want = saved
    got = run_ranks(_load, 1, roots["full"], 1, 4)[0]  # the saved base replaces seed 4's
    assert not isinstance(got, str), got
    for n, t in want.items():
        assert torch.equal(got[n], t), n
