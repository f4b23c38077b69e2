"""Qwen3-MoE generation on a GPU: the decode step captured in CUDA graphs runs every expert
weighted by the routing (rollout/moe.py `dense`, no host sync), eager decode groups tokens by
expert (`sparse`); fp32 greedy tokens equal each other, the CPU path's and transformers'; with
decode_kernels=auto the MoE model takes the torch path, compiled decode included."""

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


def test_moe_graphs_match_eager_cpu_and_transformers(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = make_checkpoint("qwen3_moe", str(tmp_path / "moe"))
    cfg = read_hf_config(path)
    params = hf_to_megatron_state_dict(load_file(os.path.join(path, "model.safetensors")), cfg)

    def gen(device):
        return Generator(model_cfg=cfg, params={k: v.to(device) for k, v in params.items()},
                         tp_group=None, device=torch.device(device), dtype=torch.float32,
                         true_vocab_size=cfg.vocab_size)

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
