"""trainer.ref_in_gen_tail on a GPU: the early reference pass runs in its own thread on its own
stream while the main thread keeps the default stream busy (allocating, computing, freeing), and
the assembled log-probs equal one pass over the whole batch bit for bit (same micro-batches: four
full-width rows each, early rows 0-3 and 8-11, the rest after)."""

import threading

import pytest
import torch

from hybridflow.config import ModelConfig, ParallelConfig
from hybridflow.data.batch import RolloutBatch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

MODEL = ModelConfig(num_layers=3, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                    num_query_groups=2, vocab_size=1000, add_qkv_bias=True)


def test_early_pass_beside_busy_default_stream(single_rank_ctx):
    from hybridflow.engine import Engine
    from hybridflow.rollout.tail_ref import TailReference
    from tests.dist.parity_util import fill_deterministic

    ref = Engine(role="ref", model_cfg=MODEL, ctx=single_rank_ctx, parallel=ParallelConfig(),
                 precision="bf16")
    fill_deterministic(ref.module, num_layers=MODEL.num_layers)
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(16, 64, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=torch.randint(1, 1000, (16, 64), generator=g),
                         prompt_mask=ones, response_ids=torch.randint(1, 1000, (16, 64), generator=g),
                         response_mask=ones, group_ids=torch.arange(16) // 4,
                         indices=torch.arange(16))
    fwd = {"micro_batch_size": 4}
    want = ref.compute_logprobs(batch, **fwd)
    tail = TailReference(ref, live_rows=8, temperature=1.0, fwd=fwd,
                         device=torch.device("cuda", torch.cuda.current_device()))
    rows = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])
    for _ in range(3):
        tail.start(rows, batch.select(rows))
        assert any(t.name == "hybridflow-tail-ref" for t in threading.enumerate())
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(50):  # the decode loop's stand-in: the default stream busy meanwhile
            x = torch.tanh(x @ x.T / 2048)
        got = tail.finish(batch)
        assert tail.early_rows == 8
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.isfinite(x).all()
