"""LoRA on the actor: the adapted model against a dense model holding W + scale * B @ A.

Every layout holds the same base weights and adapters (each rank its shard of one deterministic
full state dict, B nonzero). The reference is a 1-rank model WITHOUT adapters whose weights are the
merged W + scale * B @ A: its log-probs must equal the adapted model's, and its full weight
gradients G give the adapters' expected gradients by the chain rule (dL/dB = scale G A^T,
dL/dA = scale B^T G, G's rows of the target unfused from the QKV / [gate; up] layout). Checked at
TP=1 and TP=2 with sequence parallelism, fp32; plus: adapters off = the base model, merge/unmerge
restores the weights bit for bit, and only adapters are trainable and in the optimizer.
"""

import pytest
import torch

from hybridflow.algo import get_policy_loss
from hybridflow.config import LoRAConfig, OptimConfig, ParallelConfig
from hybridflow.parallel import groups
from tests.dist.launcher import run_ranks
from tests.dist.parity_util import fill_deterministic, gather_full
from tests.dist.test_parallel_parity import MODEL, _global_batch

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["all-linear"])
SCALE = LORA.alpha / LORA.rank


def _loss_fn(num_tokens):
    pg = get_policy_loss("vanilla")

    def loss_fn(out, mb):
        loss, m = pg(logprobs=out["logprobs"], old_logprobs=mb.old_logprobs,
                     advantages=mb.advantages, response_mask=mb.response_mask,
                     num_tokens=num_tokens)
        return loss, {"pg_loss": loss}
    return loss_fn


def _engine(ctx, tp, sp, lora, pp=1):
    from hybridflow.engine import Engine

    par = ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp, pipeline_parallel_size=pp)
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=par, precision="fp32",
                 optim=OptimConfig(lr=1e-3, clip_grad=0.0), lora=lora)
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
    eng.optimizer.reload_model_params()
    return eng


def _lora_worker(tp: int, sp: bool, pp: int = 1):
    from hybridflow.models.lora import adapters_disabled, merged_adapters

    ctx = groups.init_model_parallel(tp=tp, pp=pp, seed=3)
    eng = _engine(ctx, tp, sp, LORA, pp)
    batch = _global_batch()
    out = {"logprobs": eng.compute_logprobs(batch, micro_batch_size=2)}
    with adapters_disabled(eng.module):
        out["base_logprobs"] = eng.compute_logprobs(batch, micro_batch_size=2)
    before = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    with merged_adapters(eng.module):
        out["merged_logprobs"] = eng.compute_logprobs(batch, micro_batch_size=2)
        out["merge_changed"] = any(not torch.equal(p, before[n])
                                   for n, p in eng.module.named_parameters())
    out["unmerge_exact"] = all(torch.equal(p, before[n]) for n, p in eng.module.named_parameters())
    metrics = eng.train_step(batch, _loss_fn(int(batch.response_mask.sum())), micro_batch_size=2)
    out["loss"] = metrics["pg_loss"]
    out.update(_trained_state(eng, before))
    out["frozen_changed"] = any(not torch.equal(p, before[n]) for n, p in eng.module.named_parameters()
                                if n not in out["trainable"])
    return out


def _trained_state(eng, before: dict) -> dict:
    """After a train step: the trainable parameters' names, their gathered gradients and values
    `before` it, and the optimizer's, grad buffer's and adapters' element counts."""
    trainable = {n: p for n, p in eng.module.named_parameters() if p.requires_grad}
    return {"trainable": sorted(trainable),
            "grads": gather_full({n: p.main_grad for n, p in trainable.items()},
                                 num_layers=MODEL.num_layers),
            "adapters": gather_full({n: before[n] for n in trainable}, num_layers=MODEL.num_layers),
            "optimizer_numel": sum(p.numel() for g in eng.optimizer.param_groups
                                   for p in g["params"]),
            "grad_buffer_numel": sum(b.grad_data.numel() for b in eng.model.buffers),
            "adapter_numel": eng.num_adapter_params}


def _fold_adapters(dense, lora) -> None:
    """`dense` (an engine without adapters) gets W + scale * B @ A of `lora`'s adapters on the same
    linears, into its weights and its optimizer's master copy."""
    from hybridflow.models.lora import adapters

    with torch.no_grad():
        linears = {id(m): a for m, a in adapters(lora.module)}
        dense_modules = dict(dense.module.named_modules())
        for name, m in lora.module.named_modules():
            if id(m) in linears:
                dense_modules[name].weight.add_(linears[id(m)].delta_weight())
    dense.optimizer.reload_model_params()


def _dense_worker():
    """1 rank: the base model with W + scale * B @ A, no adapters; its log-probs and weight grads."""
    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3)
    lora = _engine(ctx, 1, False, LORA)
    dense = _engine(ctx, 1, False, None)
    batch = _global_batch()
    out = {"base_logprobs": dense.compute_logprobs(batch, micro_batch_size=2)}
    _fold_adapters(dense, lora)
    out["logprobs"] = dense.compute_logprobs(batch, micro_batch_size=2)
    dense.train_step(batch, _loss_fn(int(batch.response_mask.sum())), micro_batch_size=2)
    out["grads"] = {n: p.main_grad.clone() for n, p in dense.module.named_parameters()}
    return out


def _rows(name: str, g: torch.Tensor, target: str) -> torch.Tensor:
    """The rows of the fused weight (gradient) `g` that PEFT's `target` owns."""
    hd = MODEL.hidden_size // MODEL.num_attention_heads
    hpg = MODEL.num_attention_heads // MODEL.num_query_groups
    if target in ("q_proj", "k_proj", "v_proj"):
        q, k, v = g.reshape(MODEL.num_query_groups, (hpg + 2) * hd, -1).split([hpg * hd, hd, hd], 1)
        return {"q_proj": q, "k_proj": k, "v_proj": v}[target].reshape(-1, g.shape[-1])
    if target in ("gate_proj", "up_proj"):
        return g.chunk(2, 0)[target == "up_proj"]
    return g


@pytest.fixture(scope="module")
def dense():
    return run_ranks(_dense_worker, 1)[0]


@pytest.mark.parametrize("tp,sp,pp", [(1, False, 1), (2, True, 1), (1, False, 2)],
                         ids=["tp1", "tp2_sp", "pp2"])
def test_lora_matches_dense_reference(dense, tp, sp, pp):
    for res in run_ranks(_lora_worker, tp * pp, tp, sp, pp):
        torch.testing.assert_close(res["logprobs"], dense["logprobs"], atol=2e-5, rtol=1e-5)
        # the adapted model differs from the base one (B is nonzero), and adapters off IS the base
        assert (res["logprobs"] - dense["base_logprobs"]).abs().max() > 1e-3
        torch.testing.assert_close(res["base_logprobs"], dense["base_logprobs"], atol=2e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(res["merged_logprobs"], dense["logprobs"], atol=2e-5,
                                   rtol=1e-5)
        assert res["merge_changed"] and res["unmerge_exact"]
        # only adapters train, and only they are in the grad buffers and the optimizer
        assert res["trainable"] and all(".lora." in n for n in res["trainable"])
        assert len(res["trainable"]) == MODEL.num_layers // pp * 7 * 2
        assert len(res["grads"]) == MODEL.num_layers * 7 * 2  # every stage's, gathered
        assert res["optimizer_numel"] == res["grad_buffer_numel"] == res["adapter_numel"]
        assert not res["frozen_changed"]
        # chain rule through the dense gradient
        checked = 0
        for name, grad in res["grads"].items():  # global layer names
            layer_linear, factor, target = name.rsplit(".", 3)[0].rsplit(".lora", 1)[0], \
                name.split(".")[-2], name.split(".")[-1]
            G = _rows(name, dense["grads"][layer_linear + ".weight"], target)
            a = res["adapters"][name.replace(f".{factor}.", ".A.")]
            b = res["adapters"][name.replace(f".{factor}.", ".B.")]
            want = SCALE * (G @ a.t()) if factor == "B" else SCALE * (b.t() @ G)
            torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4, msg=name)
            checked += 1
        assert checked == len(res["grads"])


def _lora_configs(eng, adapter_only: bool) -> dict:
    """adapter_configs of save_checkpoint: {} (the whole model is saved) or adapters only."""
    if not adapter_only:
        return {}
    import dataclasses

    from hybridflow.checkpoint.base import base_identity

    return {"actor": {**dataclasses.asdict(LORA), "adapter_only": True,
                      "base": base_identity(MODEL, eng.module, seed=3)}}


def _save_tp2(root: str, adapter_only: bool):
    """TP=2 + SP: one update (Adam state), save; the adapters and their Adam moments, full."""
    from hybridflow.checkpoint import save_checkpoint

    ctx = groups.init_model_parallel(tp=2, pp=1, seed=3)
    eng = _engine(ctx, 2, True, LORA)
    batch = _global_batch()
    eng.train_step(batch, _loss_fn(int(batch.response_mask.sum())), micro_batch_size=2)
    save_checkpoint(root, step=1, models={"actor": [eng.model]},
                    optimizers={"actor": eng.optimizer}, schedulers={"actor": eng.scheduler},
                    adapter_configs=_lora_configs(eng, adapter_only))
    return _adapter_state(eng)


def _adapter_state(eng):
    params = {n: p for n, p in eng.module.named_parameters() if p.requires_grad}
    state = eng.optimizer.optimizer.state if hasattr(eng.optimizer, "optimizer") else None
    moments = {n: state[p]["exp_avg"] for n, p in params.items()} if state else {}
    return {"weights": gather_full({n: p for n, p in params.items()},
                                   num_layers=MODEL.num_layers),
            "exp_avg": gather_full(moments, num_layers=MODEL.num_layers)}


def _load_tp1(root: str, adapter_only: bool):
    """A fresh TP=1 LoRA actor (B = 0) loads the TP=2 checkpoint; then one more update works."""
    from hybridflow.checkpoint import load_checkpoint

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3)
    eng = _engine(ctx, 1, False, LORA)
    with torch.no_grad():
        for n, p in eng.module.named_parameters():
            if ".lora." in n:
                p.zero_()
    # adapters only: the base (filled the same at any TP) must have the saved fingerprint
    bases = {r: c["base"] for r, c in _lora_configs(eng, adapter_only).items()}
    load_checkpoint(root, models={"actor": [eng.model]}, optimizers={"actor": eng.optimizer},
                    schedulers={"actor": eng.scheduler}, load_rng=False, base_identities=bases)
    return _adapter_state(eng)


@pytest.mark.parametrize("adapter_only", [False, True], ids=["full", "adapters_only"])
def test_adapter_checkpoint_reshards_tp2_to_tp1(tmp_path, adapter_only):
    saved = run_ranks(_save_tp2, 2, str(tmp_path), adapter_only)[0]
    loaded = run_ranks(_load_tp1, 1, str(tmp_path), adapter_only)[0]
    assert len(saved["weights"]) == MODEL.num_layers * 7 * 2
    for n, w in saved["weights"].items():
        assert torch.equal(loaded["weights"][n], w), n
    assert saved["exp_avg"] and set(saved["exp_avg"]) == set(loaded["exp_avg"])
    for n, m in saved["exp_avg"].items():
        assert torch.equal(loaded["exp_avg"][n], m), n
