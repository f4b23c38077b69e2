"""Qwen3-MoE generation on a GPU: the decode step captured in CUDA graphs runs every expert
weighted by the routing (rollout/moe.py `dense`, no host sync), eager decode groups tokens by
expert (`sparse`); fp32 greedy tokens equal each other, the CPU path's and transformers'; with
decode_kernels=auto the MoE model takes the torch path, compiled decode included. Recording the
routed experts (actor.router_replay=R3) in the graphed decode, with padded bucket rows, KV windows
and compaction buckets warmed up and captured up front, records what eager decoding records."""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("transformers")

from hybridflow.config import RolloutConfig  # noqa: E402
from hybridflow.models.hf import hf_to_megatron_state_dict, read_hf_config  # noqa: E402
from hybridflow.rollout import Generator  # noqa: E402
from tests.hf_models import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = [[3, 17, 99, 5], [42], [7, 8, 9, 10, 11, 12, 13]]


def _checkpoint(tmp_path):
    """(path, a factory of fp32 generators of the tiny Qwen3-MoE checkpoint on a device)."""
    from safetensors.torch import load_file

    path = make_checkpoint("qwen3_moe", str(tmp_path / "moe"))
    cfg = read_hf_config(path)
    params = hf_to_megatron_state_dict(load_file(os.path.join(path, "model.safetensors")), cfg)

    def gen(device):
        return Generator(model_cfg=cfg, params={k: v.to(device) for k, v in params.items()},
                         tp_group=None, device=torch.device(device), dtype=torch.float32,
                         true_vocab_size=cfg.vocab_size)

    return path, gen


def test_moe_graphs_match_eager_cpu_and_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path, gen = _checkpoint(tmp_path)
    rc = RolloutConfig(max_new_tokens=10, temperature=0.0, n=2)
    cpu = gen("cpu").generate(PROMPTS, cfg=rc, eos_id=-1, pad_id=0, seed=0).response_ids
    g = gen("cuda")
    graphed = g.generate(PROMPTS, cfg=rc, eos_id=-1, pad_id=0, seed=0).response_ids
    eager = g.generate(PROMPTS, cfg=dataclasses.replace(rc, cuda_graphs=False), eos_id=-1,
                       pad_id=0, seed=0).response_ids
    compiled = g.generate(PROMPTS, cfg=dataclasses.replace(rc, compile_decode=True), eos_id=-1,
                          pad_id=0, seed=0).response_ids
    assert torch.equal(graphed.cpu(), eager.cpu()) and torch.equal(graphed.cpu(), cpu)
    assert torch.equal(compiled.cpu(), cpu)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                               dtype=torch.float32).eval()
    for i, p in enumerate(PROMPTS):
        want = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert cpu[2 * i].tolist() == want.tolist(), i
    with pytest.raises(ValueError, match="mixture-of-experts"):
        g.generate(PROMPTS, cfg=dataclasses.replace(rc, decode_kernels="triton"), eos_id=-1,
                   pad_id=0, seed=0)


def test_moe_recording_under_graphs_equals_eager_and_cpu(tmp_path):
    """6 rows in a bucket of 8 (2 padded rows), two KV windows per bucket (7 + 70 columns), rows
    stopping at different steps (greedy, an EOS row 0 reaches early) and compaction into ladder
    buckets 4 / 2 / 1 captured up front: each step's warm-ups run on fresh buffers (step counter
    0) before its capture. The recorded ids and tokens equal the eager GPU run's and the CPU's."""
    from hybridflow.rollout.options import DecodeOptions

    _, gen = _checkpoint(tmp_path)
    rc = RolloutConfig(max_new_tokens=70, temperature=0.0, n=2, return_logprobs=True)
    cpu_gen, g = gen("cpu"), gen("cuda")
    eos = int(cpu_gen.generate(PROMPTS, cfg=rc, eos_id=-1, pad_id=0, seed=0).response_ids[0, 3])
    opts = DecodeOptions.from_config(rc).replace(kv_window=64, compact_finished_rows=True,
                                                 check_every=2, min_graphed_bucket=1)
    kw = dict(cfg=rc, eos_id=eos, pad_id=0, seed=0, record_experts=True)
    graphed = g.generate(PROMPTS, options=opts, **kw)
    assert g.stats["compactions"] > 0
    eager = g.generate(PROMPTS, options=opts.replace(cuda_graphs=False), **kw)
    cpu = cpu_gen.generate(PROMPTS, options=opts, **kw)
    assert len(set(cpu.response_mask.sum(1).tolist())) > 1
    for name in ("response_ids", "response_mask", "prompt_experts", "response_experts"):
        assert torch.equal(getattr(graphed, name).cpu(), getattr(eager, name).cpu()), name
        assert torch.equal(getattr(graphed, name).cpu(), getattr(cpu, name)), name
    g.release()
