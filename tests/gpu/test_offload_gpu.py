"""trainer.offload_ref on a GPU: the reference's host copy is pinned and made once; a prefetching
onload copies on a side stream and the ref pass after `onload()` gives the log-probs of a reference
that never left the GPU; offloading again frees the device copy without a new host copy."""

import pytest
import torch

from hybridflow.config import ModelConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

MODEL = ModelConfig(num_layers=3, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                    num_query_groups=2, vocab_size=1000, add_qkv_bias=True)


def test_prefetched_reference_matches_a_resident_one(single_rank_ctx):
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    ctx = single_rank_ctx
    engines = []
    for _ in range(2):
        eng = Engine(role="ref", model_cfg=MODEL, ctx=ctx, parallel=ParallelConfig(),
                     precision="bf16")
        fill_deterministic(eng.module, num_layers=MODEL.num_layers)
        engines.append(eng)
    resident, offloaded = engines
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(8, 16, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=torch.randint(1, 1000, (8, 16), generator=g), prompt_mask=ones,
                         response_ids=torch.randint(1, 1000, (8, 16), generator=g),
                         response_mask=ones, group_ids=torch.arange(8) // 2,
                         indices=torch.arange(8))
    want = resident.compute_logprobs(batch, micro_batch_size=4)
    offloaded.offload()
    host = list(offloaded._host)
    assert all(h.is_pinned() for h in host)
    assert all(p.device.type == "cpu" for p in offloaded.module.parameters())
    weights = sum(h.numel() * h.element_size() for h in host)
    for _ in range(2):
        free = torch.cuda.memory_allocated()
        offloaded.onload(prefetch=True)
        assert torch.cuda.memory_allocated() - free >= weights  # held from the call on
        offloaded.onload()
        got = offloaded.compute_logprobs(batch, micro_batch_size=4)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        held = torch.cuda.memory_allocated()
        offloaded.offload()
        assert held - torch.cuda.memory_allocated() >= weights  # the device copy is freed
        # no new host copy: the same pinned storage (`p.data` is a new tensor object each time)
        assert [h.data_ptr() for h in offloaded._host] == [h.data_ptr() for h in host]
