"""Checkpoint save/load across parallel layouts, on gloo CPU ranks.

Two spawns. The first (2 ranks) trains a tiny actor and critic at TP=2 with the plain optimizer,
saves, then resumes (a) in the same layout and (b) at TP=1 x DP=2 with the distributed optimizer,
and saves from there. The second (1 rank) resumes both checkpoints at TP=1 with the plain optimizer,
checks `load_full_state_dict` (also of a PP=2 checkpoint with tied embeddings), atomicity under a failed rename, `keep_last` pruning and the shape
error. "Resumes" means: the loaded weights equal the saved ones and one more identical optimizer step
gives the weights the uninterrupted run got (exactly in the same layout, to fp32 rounding otherwise).
The vocabulary (63) is padded to 64 at TP=2 and not at TP=1, so the padding is resharded as well.
Comparing the continuation across layouts also requires TP=2 and TP=1 training to agree.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist.launcher import run_ranks

VOCAB, BATCH, SEQ = 63, 4, 8
ROLES = ("actor", "critic")


def _cfg(**changes):
    from hybridflow.config import ModelConfig

    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                num_query_groups=2, vocab_size=VOCAB, add_qkv_bias=True)
    return ModelConfig(**{**base, **changes})


def _build(*, tp: int, dist_opt: bool, seed: int, cfg=None):
    """role -> (DDP model, optimizer, scheduler) in a fresh TP x DP layout."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hybridflow.models.build import build_model
    from hybridflow.parallel import groups

    ctx = groups.init_model_parallel(tp=tp, pp=1, seed=seed)
    out = {}
    for role in ROLES:
        model = build_model(cfg or _cfg(), role=role, ctx=ctx)
        ddp = DDP(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt), model)
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-3, bf16=False, params_dtype=torch.float32,
            use_distributed_optimizer=dist_opt, clip_grad=1.0), [ddp], use_gloo_process_groups=False)
        sched = OptimizerParamScheduler(  # warmup: the LR depends on the restored step count
            opt, init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=4, lr_decay_steps=10,
            lr_decay_style="linear", start_wd=0.01, end_wd=0.01, wd_incr_steps=10,
            wd_incr_style="constant")
        model.config.no_sync_func = ddp.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
        out[role] = (ddp, opt, sched)
    return out


def _train_step(models: dict, step: int) -> None:
    """One optimizer step of every role on the global batch of `step` (split over DP).
    Actor loss: mean square of the true-vocab logits; critic: mean square of the values.
    Each rank's loss covers its vocab shard and DP slice, so the gradient is layout-independent."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)  # (B, S)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = tokens.chunk(dp)[dp_rank]  # (B/DP, S)
    pos = torch.arange(SEQ).expand_as(local)
    for role, (ddp, opt, sched) in models.items():
        ddp.zero_grad_buffer()
        opt.zero_grad()

        def forward_step(_it, model, role=role):
            out = model(local, pos, None)  # (b, S, V/TP) or (b, S, 1)

            def loss_fn(o):
                if role == "actor":
                    lo = ps.get_tensor_model_parallel_rank() * o.shape[-1]
                    o = o[..., :max(0, min(o.shape[-1], VOCAB - lo))]
                    return o.float().square().sum() / (local.numel() * VOCAB), {}
                return o.float().square().sum() / local.numel(), {}

            return out, loss_fn

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]),
                                    model=[ddp], num_microbatches=1, seq_length=SEQ,
                                    micro_batch_size=local.shape[0], forward_only=False)
        ok, _, _ = opt.step()
        assert ok
        sched.step(increment=1)


def _full_weights(models: dict) -> dict:
    """role -> {param name: full tensor} gathered over TP, vocab trimmed to the true size."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.parallel.param_rules import VOCAB as VOCAB_RULE
    from hybridflow.parallel.param_rules import merge_shards, param_rule

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for role, (ddp, _, _) in models.items():
        full = {}
        for name, p in ddp.module.named_parameters():
            shards = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(shards, p.data.contiguous(), group=group)
            t = merge_shards(name, shards)
            full[name] = (t[:VOCAB] if param_rule(name) == VOCAB_RULE else t).clone()
        out[role] = full
    return out


def _parts(models):
    return ({r: [m[0]] for r, m in models.items()}, {r: m[1] for r, m in models.items()},
            {r: m[2] for r, m in models.items()})


def _save(root, step, models, **kw):
    from hybridflow.checkpoint import save_checkpoint

    mods, opts, scheds = _parts(models)
    return save_checkpoint(root, step=step, models=mods, optimizers=opts, schedulers=scheds,
                           model_configs={r: _cfg() for r in ROLES}, **kw)


def _load(root, models, **kw):
    from hybridflow.checkpoint import load_checkpoint

    mods, opts, scheds = _parts(models)
    return load_checkpoint(root, models=mods, optimizers=opts, schedulers=scheds, **kw)


# ------------------------------------------------------------------------------ spawned bodies
def save_and_reshard_2ranks(root: str, root_dist: str):
    res = {}
    # A: the uninterrupted run at TP=2 (plain optimizer, DP=1)
    models = _build(tp=2, dist_opt=False, seed=1234)
    _train_step(models, 1)
    _save(root, 1, models, trainer_state={"sampler": {"epoch": 0, "consumed": 4},
                                          "kl_coef": 0.001, "ids": torch.arange(3)})
    res["rand_after_save"] = torch.rand(3)
    res["w1"] = _full_weights(models)
    _train_step(models, 2)
    res["w2"] = _full_weights(models)

    # B: same layout, fresh weights, resume
    models = _build(tp=2, dist_opt=False, seed=99)
    state = _load(root, models)
    res["state_b"] = state
    res["rand_b"] = torch.rand(3)
    res["w1_b"] = _full_weights(models)
    _train_step(models, 2)
    res["w2_b"] = _full_weights(models)

    # C: TP=1 x DP=2 with the distributed optimizer, resume, then save from this layout
    models = _build(tp=1, dist_opt=True, seed=7)
    res["lr_before_c"] = models["actor"][1].param_groups[0]["lr"]
    _load(root, models, step=1)
    res["w1_c"] = _full_weights(models)
    _train_step(models, 2)
    res["w2_c"] = _full_weights(models)
    _save(root_dist, 2, models)
    _train_step(models, 3)
    res["w3_c"] = _full_weights(models)

    # PP=2 with tied embeddings (weights only): global layer names come back from the files
    from hybridflow.checkpoint import save_checkpoint
    from hybridflow.models.build import build_model
    from hybridflow.parallel import groups
    from hybridflow.parallel.param_rules import global_name

    ctx = groups.init_model_parallel(tp=1, pp=2, seed=11)
    tied = build_model(_cfg(tie_word_embeddings=True), role="actor", ctx=ctx)
    save_checkpoint(os.path.join(root_dist, "pp"), step=1, models={"actor": [tied]},
                    model_configs={"actor": _cfg(tie_word_embeddings=True)})
    res["pp_params"] = {global_name(n, pp_rank=torch.distributed.get_rank(), num_layers=2,
                                    pp_size=2): p.detach()[:VOCAB].clone() if "embedding" in n
                        else p.detach().clone()
                        for n, p in tied.named_parameters() if n != "output_layer.weight"}
    return res


def resume_1rank(root: str, root_dist: str, export_check_dir: str):
    from hybridflow import checkpoint

    res = {}
    # D: the TP=2 checkpoint at TP=1 (plain optimizer)
    models = _build(tp=1, dist_opt=False, seed=5)
    _load(root, models, step=1)
    res["w1_d"] = _full_weights(models)
    _train_step(models, 2)
    res["w2_d"] = _full_weights(models)
    # E: the distributed-optimizer (DP=2) checkpoint at TP=1 (plain optimizer)
    models = _build(tp=1, dist_opt=False, seed=6)
    _load(root_dist, models)
    res["w2_e"] = _full_weights(models)
    _train_step(models, 3)
    res["w3_e"] = _full_weights(models)
    # F: full state dicts straight from the files
    res["full_actor"], cfg = checkpoint.load_full_state_dict(os.path.join(root, "step_1"))
    res["full_critic"], _ = checkpoint.load_full_state_dict(os.path.join(root, "step_1"),
                                                            role="critic")
    res["full_cfg"] = cfg
    res["full_pp"], _ = checkpoint.load_full_state_dict(os.path.join(root_dist, "pp", "step_1"))

    # G: atomicity. Step 2 saved normally, step 3's rename fails: `latest` stays at 2.
    _save(root, 2, models)
    res["w_saved2"] = _full_weights(models)
    _train_step(models, 4)
    real_rename = checkpoint.os.rename

    def crash(src, dst):
        raise OSError("simulated crash")

    checkpoint.os.rename = crash
    try:
        _save(root, 3, models)
        res["crash_raised"] = False
    except OSError:
        res["crash_raised"] = True
    finally:
        checkpoint.os.rename = real_rename
    res["latest_after_crash"] = checkpoint.latest_step(root)
    res["tmp_left"] = os.path.isdir(os.path.join(root, "step_3.tmp"))
    models = _build(tp=1, dist_opt=False, seed=8)
    res["loaded_step"] = _load(root, models)["step"]
    res["w_after_crash"] = _full_weights(models)
    _save(root, 3, models, keep_last=2)  # cleans the stale tmp, prunes step_1
    res["dirs"] = sorted(os.listdir(root))

    # H: shapes that do not match the checkpoint
    bad = _build(tp=1, dist_opt=False, seed=1, cfg=_cfg(ffn_hidden_size=48))
    try:
        _load(root, bad)
        res["shape_error"] = None
    except ValueError as e:
        res["shape_error"] = str(e)
    return res


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    root_dist = str(tmp_path_factory.mktemp("ckpt_dist"))
    res = run_ranks(save_and_reshard_2ranks, 2, root, root_dist)
    return root, root_dist, res


def _assert_weights(a: dict, b: dict, exact: bool):
    for role in ROLES:
        assert a[role].keys() == b[role].keys()
        for name in a[role]:
            if exact:
                assert torch.equal(a[role][name], b[role][name]), (role, name)
            else:
                torch.testing.assert_close(a[role][name], b[role][name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{role} {name}: {m}")


def test_resume_same_layout_and_at_dp2_distributed_optimizer(trained):
    root, _, results = trained
    r = results[0]
    torch.testing.assert_close(results[1]["w2_c"], r["w2_c"])  # DP ranks agree
    assert not torch.equal(r["w1"]["actor"]["decoder.final_layernorm.weight"],
                           r["w2"]["actor"]["decoder.final_layernorm.weight"])
    _assert_weights(r["w1_b"], r["w1"], exact=True)
    _assert_weights(r["w2_b"], r["w2"], exact=True)
    assert r["state_b"] == {**r["state_b"], "step": 1, "kl_coef": 0.001,
                            "sampler": {"epoch": 0, "consumed": 4}}
    assert torch.equal(r["state_b"]["ids"], torch.arange(3))
    assert torch.equal(r["rand_b"], r["rand_after_save"])  # same layout: RNG restored
    assert r["lr_before_c"] == 0.0
    _assert_weights(r["w1_c"], r["w1"], exact=True)
    _assert_weights(r["w2_c"], r["w2"], exact=False)
    assert sorted(os.listdir(root)) == ["latest", "step_1"]
    step1 = os.path.join(root, "step_1")
    assert {"actor", "critic", "rng", "trainer_state.json", "trainer_state.pt", "meta.json",
            "model_config_actor.json", "model_config_critic.json"} <= set(os.listdir(step1))


def test_resume_at_one_rank_atomicity_and_errors(trained):
    root, root_dist, results = trained
    ref = results[0]
    r = run_ranks(resume_1rank, 1, root, root_dist, "")[0]
    _assert_weights(r["w1_d"], ref["w1"], exact=True)
    _assert_weights(r["w2_d"], ref["w2"], exact=False)
    _assert_weights(r["w2_e"], ref["w2_c"], exact=True)
    _assert_weights(r["w3_e"], ref["w3_c"], exact=False)
    # load_full_state_dict: global names, full tensors, equal to the gathered weights
    for role, full in (("actor", r["full_actor"]), ("critic", r["full_critic"])):
        assert full.keys() == ref["w1"][role].keys()
        for name, t in full.items():
            assert torch.equal(t, ref["w1"][role][name]), (role, name)
    assert r["full_cfg"] == _cfg()
    pp_ref = {**results[0]["pp_params"], **results[1]["pp_params"]}  # PP=2 stages
    assert r["full_pp"].keys() == pp_ref.keys()  # tied: no output_layer.weight
    for name, t in r["full_pp"].items():
        assert torch.equal(t, pp_ref[name]), name
    # atomicity
    assert r["crash_raised"] and r["tmp_left"]
    assert r["latest_after_crash"] == 2 and r["loaded_step"] == 2
    _assert_weights(r["w_after_crash"], r["w_saved2"], exact=True)
    assert r["dirs"] == ["latest", "step_2", "step_3"]
    assert "linear_fc1" in r["shape_error"] or "linear_fc2" in r["shape_error"]


def test_missing_checkpoints(tmp_path):
    from hybridflow.checkpoint import latest_step, load_checkpoint, load_full_state_dict

    assert latest_step(str(tmp_path / "nothing")) is None
    assert load_checkpoint(str(tmp_path / "nothing"), models={}) is None
    with pytest.raises(FileNotFoundError, match="step_5"):
        load_checkpoint(str(tmp_path), models={}, step=5)
    (tmp_path / "step_5").mkdir()
    assert latest_step(str(tmp_path)) == 5  # no `latest` file: newest complete dir
    with pytest.raises(FileNotFoundError, match="reward"):
        load_checkpoint(str(tmp_path), models={"reward": []})
    with pytest.raises(FileNotFoundError, match="critic"):
        load_full_state_dict(str(tmp_path / "step_5"), role="critic")
