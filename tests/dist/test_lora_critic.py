"""LoRA on the critic (critic.lora): the adapted critic against a dense critic holding
W + scale * B @ A, as tests/dist/test_lora.py does for the actor.

Every layout holds the same base weights, value head and adapters (B nonzero). The reference is a
1-rank critic WITHOUT adapters whose weights are the merged ones: its values must equal the adapted
critic's, its value head gradient the adapted critic's (the head is new, so it trains in full), and
its weight gradients G give the adapters' expected gradients by the chain rule. Checked at TP=1 and
TP=2 with sequence parallelism, fp32; only the adapters and the head are trainable, in the grad
buffers and in the optimizer.
"""

import pytest
import torch

from hybridflow.config import LoRAConfig, OptimConfig, ParallelConfig
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks
from tests.dist.parity_util import fill_deterministic
from tests.dist.test_lora import _fold_adapters, _rows, _trained_state
from tests.dist.test_parallel_parity import MODEL, _global_batch

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["all-linear"])
SCALE = LORA.alpha / LORA.rank
HEAD = ("output_layer.linear.weight", "output_layer.linear.bias")


def _value_loss(num_tokens):
    def loss_fn(out, mb):  # squared error against a fixed target (the batch's advantages)
        mask = mb.response_mask.to(out["values"].dtype)
        err = out["values"] - mb.advantages.to(out["values"].dtype)
        loss = (err * err * mask).sum() / num_tokens
        return loss, {"vf_loss": loss}
    return loss_fn


def _engine(ctx, tp, sp, lora):
    from hybridflow.engine import Engine

    par = ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp)
    eng = Engine(role="critic", model_cfg=MODEL, ctx=ctx, parallel=par, precision="fp32",
                 optim=OptimConfig(lr=1e-3, clip_grad=0.0), lora=lora)
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
    eng.optimizer.reload_model_params()
    return eng


def _lora_worker(tp: int, sp: bool):
    from hybridflow.models.lora import adapters_disabled

    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=3)
    eng = _engine(ctx, tp, sp, LORA)
    batch = _global_batch()
    out = {"values": eng.compute_values(batch, micro_batch_size=2)}
    with adapters_disabled(eng.module):
        out["base_values"] = eng.compute_values(batch, micro_batch_size=2)
    before = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    metrics = eng.train_step(batch, _value_loss(int(batch.response_mask.sum())),
                             micro_batch_size=2)
    out["loss"] = metrics["vf_loss"]
    out.update(_trained_state(eng, before))
    out["changed"] = sorted(n for n, p in eng.module.named_parameters()
                            if not torch.equal(p, before[n]))
    return out


def _dense_worker():
    """1 rank: the base critic with W + scale * B @ A, no adapters; its values and grads."""
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3)
    lora = _engine(ctx, 1, False, LORA)
    dense = _engine(ctx, 1, False, None)
    batch = _global_batch()
    out = {"base_values": dense.compute_values(batch, micro_batch_size=2)}
    _fold_adapters(dense, lora)
    out["values"] = dense.compute_values(batch, micro_batch_size=2)
    m = dense.train_step(batch, _value_loss(int(batch.response_mask.sum())), micro_batch_size=2)
    out["loss"] = m["vf_loss"]
    out["grads"] = {n: p.main_grad.clone() for n, p in dense.module.named_parameters()}
    return out


@pytest.fixture(scope="module")
def dense():
    return run_ranks(_dense_worker, 1)[0]


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)], ids=["tp1", "tp2_sp"])
def test_critic_lora_matches_dense_reference(dense, tp, sp):
    for res in run_ranks(_lora_worker, tp, tp, sp):
        torch.testing.assert_close(res["values"], dense["values"], atol=2e-5, rtol=1e-5)
        assert (res["values"] - dense["base_values"]).abs().max() > 1e-3  # the adapters act
        torch.testing.assert_close(res["base_values"], dense["base_values"], atol=2e-5,
                                   rtol=1e-5)
        assert res["loss"] == pytest.approx(dense["loss"], rel=1e-5)
        # only adapters and the value head train; only they have grads and optimizer state
        adapters = [n for n in res["trainable"] if ".lora." in n]
        assert len(adapters) == MODEL.num_layers * 7 * 2
        assert sorted(set(res["trainable"]) - set(adapters)) == sorted(HEAD)
        head_numel = MODEL.hidden_size + 1
        assert res["optimizer_numel"] == res["grad_buffer_numel"] \
            == res["adapter_numel"] + head_numel
        assert set(res["changed"]) <= set(res["trainable"]) and set(HEAD) <= set(res["changed"])
        for name in HEAD:  # the head trains in full: the dense critic's own gradient
            torch.testing.assert_close(res["grads"][name], dense["grads"][name], atol=1e-5,
                                       rtol=1e-4, msg=name)
        for name in adapters:  # chain rule through the dense gradient
            grad = res["grads"][name]
            layer_linear = name.rsplit(".lora", 1)[0]
            factor, target = name.split(".")[-2], name.split(".")[-1]
            G = _rows(name, dense["grads"][layer_linear + ".weight"], target)
            a = res["adapters"][name.replace(f".{factor}.", ".A.")]
            b = res["adapters"][name.replace(f".{factor}.", ".B.")]
            want = SCALE * (G @ a.t()) if factor == "B" else SCALE * (b.t() @ G)
            torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4, msg=name)
