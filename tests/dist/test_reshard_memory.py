"""The cost model's reshard buffer (cost/memory.py reshard_buffer_bytes) against what the Resharder
allocates, on 2 gloo ranks: a TP_t=2 model gathered to TP_g=1, and to TP_g=2 (no reshard).

Measured: the bytes of the distinct storages under the gathered weights that are not training
parameters (what gather() allocated), and `Resharder.allocated_bytes()`. The model counts bf16
(2 bytes per weight); the CPU model is fp32, so the bytes are compared per element."""

import pytest
import torch

from hybridflow.config import ModelConfig
from tests.dist.launcher import run_ranks

CFG = dict(name="tiny-reshard-mem", num_layers=2, hidden_size=64, ffn_hidden_size=128,
           num_attention_heads=8, num_query_groups=4, vocab_size=64, add_qkv_bias=True)


def _allocated() -> dict:
    import torch.distributed as dist

    from hybridflow.models.build import build_model
    from hybridflow.parallel import groups
    from hybridflow.parallel.layout import Layout
    from hybridflow.parallel.reshard import Resharder

    cfg = ModelConfig(**CFG)
    ctx = groups.init_model_parallel(tp=2, pp=1, seed=0)
    model = build_model(cfg, role="actor", ctx=ctx).eval()
    params = dict(model.named_parameters())
    train = {p.untyped_storage().data_ptr() for p in params.values()}
    results = {}
    for tp_g in (1, 2):
        lay = Layout(world_size=dist.get_world_size(), tp_t=2, pp_t=1, tp_g=tp_g)
        res = Resharder(model, layout=lay, groups=groups.new_reshard_groups(lay))
        out = res.gather()
        new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in out.values()
               if t.untyped_storage().data_ptr() not in train}
        results[tp_g] = {"storages": sum(new.values()), "plan": res.allocated_bytes(),
                         "train": sum(p.numel() * p.element_size() for p in params.values()),
                         "elem": next(iter(params.values())).element_size()}
        res.release()
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_allocated, 2)


@pytest.mark.parametrize("tp_g", [1, 2])
def test_reshard_buffer_is_what_the_resharder_allocates(per_rank, tp_g):
    from hybridflow.cost.memory import reshard_buffer_bytes, reshard_received_bytes
    from hybridflow.parallel.layout import Layout

    shape = ModelConfig(**CFG)
    lay = Layout(world_size=2, tp_t=2, pp_t=1, tp_g=tp_g)
    predicted = reshard_buffer_bytes(shape, lay) / 2            # elements (bf16 in the model)
    for r in (results[tp_g] for results in per_rank):
        assert r["storages"] == r["plan"]
        assert r["storages"] / r["elem"] == predicted
        if tp_g == 1:  # the whole gen shard: more than the half it receives
            assert r["storages"] > r["train"]
            assert predicted > reshard_received_bytes(shape, lay) / 2
        else:
            assert predicted == 0
