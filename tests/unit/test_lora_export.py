"""LoRA adapters leave a checkpoint as a PEFT adapter directory that `peft` loads onto the Hugging
Face base (same logits as our adapted model), or merged into a full HF model; and a bf16
merge/unmerge restores the weights bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist.launcher import run_ranks

SEQ = 7


def _tokens(vocab):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


def save_adapted_actor(root: str, hf_dir: str, targets: list, adapter_only: bool = False,
                       greedy_prompts: list | None = None, max_new_tokens: int = 0):
    """Spawned rank: an actor from the HF base with random nonzero adapters; save (the whole model,
    or with `adapter_only` the adapters and the base's identity, as training does); its logits,
    or with `greedy_prompts` its greedy responses as the rollout generates them (the in-place
    generator on the weights with the adapters merged in)."""
    import dataclasses

    from hybridflow.checkpoint import save_checkpoint
    from hybridflow.config import LoRAConfig, OptimConfig, ParallelConfig
    from hybridflow.engine import Engine
    from hybridflow.components import load_pretrained
    from hybridflow.models.hf import read_hf_config
    from hybridflow.models.lora import adapters
    from hybridflow.parallel import groups

    ctx = groups.init_model_parallel(tp=1, pp=1, seed=3)
    cfg = dataclasses.replace(read_hf_config(hf_dir), hf_path=hf_dir)
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    eng = Engine(role="actor", model_cfg=cfg, ctx=ctx, parallel=ParallelConfig(),
                 precision="fp32", optim=OptimConfig(), lora=lora)
    load_pretrained(eng, cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, a in adapters(eng.module):
            for b in a.B.values():
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    tokens = _tokens(cfg.vocab_size)
    eng.module.eval()
    with torch.no_grad():
        logits = eng.module(tokens, torch.arange(SEQ).expand_as(tokens), None)[..., :cfg.vocab_size]
    lora_dict = {**dataclasses.asdict(lora), "base_model": hf_dir}
    if adapter_only:
        from hybridflow.checkpoint.base import base_identity

        lora_dict.update(adapter_only=True, base=base_identity(cfg, eng.module, seed=3))
    save_checkpoint(root, step=2, models={"actor": [eng.model]}, model_configs={"actor": cfg},
                    adapter_configs={"actor": lora_dict})
    if greedy_prompts is None:
        return logits
    from hybridflow.config import RolloutConfig
    from hybridflow.models.lora import is_adapter_name, merged_adapters
    from hybridflow.rollout import Generator

    with merged_adapters(eng.module):  # as the rollout stage does (stage.py)
        params = {n: p for n, p in eng.module.named_parameters() if not is_adapter_name(n)}
        gen = Generator(model_cfg=cfg, params=params, tp_group=None, device=torch.device("cpu"),
                        dtype=torch.float32, true_vocab_size=cfg.vocab_size)
        out = gen.generate(greedy_prompts, cfg=RolloutConfig(max_new_tokens=max_new_tokens,
                                                             temperature=0.0),
                           eos_id=-1, pad_id=0, seed=0)
    return [out.response_ids[i].tolist() for i in range(len(greedy_prompts))]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.hf_models import make_checkpoint

    return make_checkpoint("qwen2", str(tmp_path_factory.mktemp("qwen2")))


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj", "up_proj"]],
                         ids=["all_linear", "q_v_up"])
def test_peft_adapter_loads_with_our_logits(hf_base, tmp_path, targets):
    peft = pytest.importorskip("peft")
    import transformers

    from hybridflow.export import main

    root = str(tmp_path / "ckpt")
    ours = run_ranks(save_adapted_actor, 1, root, hf_base, targets)[0]
    out = str(tmp_path / "adapter")
    assert main([root, out]) == 0
    with open(os.path.join(out, "adapter_config.json")) as f:
        conf = json.load(f)
    want = (["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
            if targets == ["all-linear"] else sorted(targets))
    assert conf["target_modules"] == want and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert conf["base_model_name_or_path"] == hf_base and conf["bias"] == "none"
    base = transformers.AutoModelForCausalLM.from_pretrained(
        hf_base, attn_implementation="eager", dtype=torch.float32).eval()
    ids = _tokens(base.config.vocab_size)
    with torch.no_grad():
        plain = base(ids).logits.clone()
    model = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        adapted = model(ids).logits
    torch.testing.assert_close(adapted, ours, rtol=1e-4, atol=1e-4)
    assert (adapted - plain).abs().max() > 1e-2  # the adapters matter
    merged_dir = str(tmp_path / "merged")
    assert main([root, merged_dir, "--merged"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        merged_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, ours, rtol=1e-4, atol=1e-4)


def test_peft_adapter_greedy_tokens_equal_ours(hf_base, tmp_path):
    """The exported adapter on the HF base, under transformers + peft (unmerged), generates
    greedily the tokens our generator does with the adapters merged in, prompt by prompt; and the
    pieces benchmarks/peft_export_eval.py scores a checkpoint with read it right."""
    peft = pytest.importorskip("peft")
    import sys

    import transformers

    from hybridflow.export import main

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import peft_export_eval as pe

    prompts, max_new = [[3, 17, 99, 5], [42, 7], [7, 8, 9, 10, 11, 12, 13]], 12
    root = str(tmp_path / "ckpt")
    ours = run_ranks(save_adapted_actor, 1, root, hf_base, ["all-linear"], False, prompts,
                     max_new)[0]
    out = str(tmp_path / "adapter")
    assert main([root, out]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(
        hf_base, attn_implementation="eager", dtype=torch.float32).eval()
    plain = [base.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    model = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        theirs = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
                  .tolist() for p in prompts]
    assert theirs == ours
    assert plain != ours  # the adapters change the greedy answers
    step = pe.resolve_checkpoint(root)
    assert step == os.path.join(root, "step_2")
    assert pe.lora_overrides(step) == ["actor.lora.rank=4", "actor.lora.alpha=8.0",
                                       "actor.lora.dropout=0.0",
                                       "actor.lora.target_modules=[all-linear]"]
    linked = tmp_path / "score" / "checkpoints"
    pe.link_step(step, linked)
    from hybridflow.checkpoint import latest_step

    assert latest_step(str(linked)) == 2 and os.path.samefile(linked / "step_2", step)


def test_peft_eval_comparison():
    """Agreement counts and identical generations of two validations of the same problems."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import peft_export_eval as pe

    a = {"scores": {"math_exact": [1, 1, 0, 0, 1], "gsm8k_strict": [1, 0, 0, 0, 0]},
         "responses": ["x #### 3<|im_end|>", "y", "z", "w<|endoftext|>", "v"]}
    b = {"scores": {"math_exact": [1, 0, 0, 1, 1], "gsm8k_strict": [1, 0, 0, 0, 1]},
         "responses": ["x #### 3", "y2", "z", "w", "v "]}
    got = pe.compare(a, b)
    assert got["identical_generations"] == 4
    m = got["math_exact"]
    assert (m["both_right"], m["both_wrong"], m["only_a"], m["only_b"], m["agree"]) == (2, 1, 1, 1, 3)
    assert m["mcnemar_p"] == 1.0 and m["accuracy_a"] == m["accuracy_b"] == 0.6
    s = got["gsm8k_strict"]
    assert (s["only_a"], s["only_b"], s["agree"]) == (0, 1, 4)
    assert pe.accuracy(a) == {"math_exact": 0.6, "gsm8k_strict": 0.2}


def test_peft_eval_stages_are_reused_by_settings(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import peft_export_eval as pe

    calls = []

    def stage(v):
        return lambda: calls.append(v) or {"v": v}

    path = tmp_path / "stage.json"
    assert pe.cached(path, {"limit": 2}, stage(1)) == {"v": 1}
    assert pe.cached(path, {"limit": 2}, stage(2)) == {"v": 1}  # same settings: kept
    assert pe.cached(path, {"limit": 3}, stage(3)) == {"v": 3}  # other settings: run again
    assert calls == [1, 3]


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def test_adapter_only_checkpoint_exports(hf_base, tmp_path, capsys):
    """The PEFT dir equals the one from a full checkpoint; --merged reads the recorded base (or
    --base, a copy), and refuses a base that is gone or is another model."""
    import shutil

    from hybridflow.export import main

    targets = ["q_proj", "v_proj", "up_proj"]
    full, only = str(tmp_path / "full"), str(tmp_path / "only")
    ours = run_ranks(save_adapted_actor, 1, full, hf_base, targets)[0]
    again = run_ranks(save_adapted_actor, 1, only, hf_base, targets, True)[0]
    assert torch.equal(ours, again)
    assert main([full, str(tmp_path / "a_full")]) == 0
    assert main([only, str(tmp_path / "a_only")]) == 0
    want, got = _tensors(str(tmp_path / "a_full")), _tensors(str(tmp_path / "a_only"))
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert main([full, str(tmp_path / "m_full"), "--merged"]) == 0
    assert main([only, str(tmp_path / "m_only"), "--merged"]) == 0
    want, got = _tensors(str(tmp_path / "m_full")), _tensors(str(tmp_path / "m_only"))
    assert sorted(want) == sorted(got)
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-6, atol=1e-6)
    moved = str(tmp_path / "base_copy")
    shutil.copytree(hf_base, moved)
    assert main([only, str(tmp_path / "m_copy"), "--merged", "--base", moved]) == 0
    capsys.readouterr()
    assert main([only, str(tmp_path / "m_none"), "--merged", "--base",
                 str(tmp_path / "nowhere")]) == 2
    assert "not available" in capsys.readouterr().err
    with open(os.path.join(moved, "config.json")) as f:
        conf = json.load(f)
    conf["rms_norm_eps"] = conf.get("rms_norm_eps", 1e-6) * 2
    with open(os.path.join(moved, "config.json"), "w") as f:
        json.dump(conf, f)
    assert main([only, str(tmp_path / "m_other"), "--merged", "--base", moved]) == 2
    err = capsys.readouterr().err
    assert "is not the one" in err and hf_base in err
    assert not os.path.exists(str(tmp_path / "m_other"))


class _Group:  # a TP group of one rank, for a module built outside torch.distributed
    def size(self):
        return 1

    def rank(self):
        return 0


def test_bf16_merge_unmerge_is_bit_exact():
    from hybridflow.models.lora import LoRAAdapter, merged_adapters

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.linear = torch.nn.Linear(64, 3 * 48, bias=False).to(torch.bfloat16)
    holder.linear.lora = LoRAAdapter(
        kind="column", parts=[("q_proj", 32, True), ("k_proj", 8, False), ("v_proj", 8, True)],
        groups=3, in_local=64, in_full=64, rank=4, alpha=8.0, dropout=0.0, tp_group=_Group(),
        tp_rank=0, sequence_parallel=False, dtype=torch.bfloat16, device="cpu",
        seeds={"q_proj": 1, "v_proj": 2})
    for b in holder.linear.lora.B.values():
        torch.nn.init.normal_(b, std=0.5)
    w = holder.linear.weight
    before = w.detach().clone()
    delta = holder.linear.lora.delta_weight()
    with merged_adapters(holder, block_rows=5):  # blocks that cut the q and v parts
        assert not holder.linear.lora.enabled
        torch.testing.assert_close(w.float(), before.float() + delta, atol=2e-2, rtol=1e-2)
        # the k rows of each group are untouched (only q and v are targets)
        k_rows = torch.arange(144).view(3, 48)[:, 32:40].reshape(-1)
        assert torch.equal(w[k_rows], before[k_rows])
        naive = (w.float() - delta).to(torch.bfloat16)
        assert not torch.equal(naive, before)  # a plain unmerge would not restore the weights
    assert holder.linear.lora.enabled
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("sync_elements", [1, 2 * 144 * 64, 1 << 26],
                         ids=["every_weight", "two_weights", "all_at_once"])
def test_merge_of_several_weights_between_host_waits(sync_elements):
    """The merge finds the positions to fix for several weights at once (a host wait per
    sync_elements weights' elements, not per block): each weight holds merged_copy's bits
    inside, and every weight's bits come back after, however the weights are grouped."""
    from hybridflow.models.lora import LoRAAdapter, merged_adapters, merged_copy

    torch.manual_seed(0)
    holder = torch.nn.Module()
    for i in range(3):
        lin = torch.nn.Linear(64, 3 * 48, bias=False).to(torch.bfloat16)
        lin.lora = LoRAAdapter(
            kind="column", parts=[("q_proj", 32, True), ("k_proj", 8, False),
                                  ("v_proj", 8, True)],
            groups=3, in_local=64, in_full=64, rank=4, alpha=8.0, dropout=0.0, tp_group=_Group(),
            tp_rank=0, sequence_parallel=False, dtype=torch.bfloat16, device="cpu",
            seeds={"q_proj": 1 + i, "v_proj": 2 + i})
        for b in lin.lora.B.values():
            torch.nn.init.normal_(b, std=0.5)
        holder.add_module(f"linear{i}", lin)
    linears = [holder.linear0, holder.linear1, holder.linear2]
    before = [lin.weight.detach().clone() for lin in linears]
    want = [merged_copy(lin.lora, w, block_rows=5) for lin, w in zip(linears, before)]
    with merged_adapters(holder, block_rows=5, sync_elements=sync_elements):
        for lin, m in zip(linears, want):
            assert not lin.lora.enabled
            assert torch.equal(lin.weight.view(torch.int16), m.view(torch.int16))
    for lin, w in zip(linears, before):
        assert lin.lora.enabled and torch.equal(lin.weight.view(torch.int16), w.view(torch.int16))


def test_config_errors():
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    for bad, key in ((["actor.lora.rank=4", "actor.lora.target_modules=[qkv]"], "target_modules"),
                     (["actor.lora.rank=-1"], "actor.lora.rank"),
                     (["actor.lora.rank=4", "actor.lora.dropout=1.5"], "actor.lora.dropout"),
                     (["actor.lora.rank=4", "model.attention_backend=local"],
                      "model.attention_backend")):
        with pytest.raises(ValueError, match=key):
            validate(load_config(["experiment=demo", *bad]), world_size=1)
    validate(load_config(["experiment=demo", "actor.lora.rank=4",
                         "actor.lora.target_modules=[q_proj,v_proj]"]),
             world_size=1)
