"""The trainer with rollout.quantization=fp8 on CPU (one gloo rank, the demo's tiny model): two GRPO
steps run end to end with truncated importance sampling turned on by the quantized defaults (cap
2.0), the rollout/training mismatch metrics reported every step (non-zero: the fp8 model's
log-probs differ from the training forward's), and the quantized weights' bytes in the step's
metrics."""

import pytest
import torch

from tests.dist.launcher import run_ranks

BASE = ["experiment=demo", "algo=grpo", "trainer.sft_warmup_steps=0", "trainer.total_steps=2",
        "trainer.save_final=false", "trainer.tensorboard=false", "trainer.progress_bar=false",
        "data.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=4",
        "algo.ppo_mini_batch_size=8", "algo.micro_batch_size_per_gpu=4",
        "algo.forward_micro_batch_size_per_gpu=8", "rollout.quantization=fp8"]


def _run(out_dir):
    from hybridflow.config import load_config
    from hybridflow.parallel import groups
    from hybridflow.trainer import Trainer

    cfg = load_config([*BASE, f"trainer.output_dir={out_dir}"])
    ctx = groups.init_model_parallel(tp=1, pp=1, tp_gen=None, seed=cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    return {"cap": trainer.cfg.algo.tis_imp_ratio_cap, "history": trainer.train()}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_ranks(_run, 1, str(tmp_path_factory.mktemp("quant_trainer")))[0]


def test_fp8_rollout_trains_with_tis_and_mismatch_metrics(result):
    assert result["cap"] == 2.0
    assert len(result["history"]) == 2
    for m in result["history"]:
        assert m["rollout_corr/kl"] != 0.0 and "rollout_corr/rollout_is_mean" in m, m
        assert 0 < m["rollout_corr/rollout_is_mean"] <= 2.0
        assert m["perf/rollout_quantized_weights_gb"] > 0
        assert torch.isfinite(torch.tensor(m["actor/pg_loss"]))
