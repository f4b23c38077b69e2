"""The update's metrics: summed over micro-batches on the device and read back once."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Reads(TorchDispatchMode):
    """Counts scalar reads (`.item()`, `float(t)`): each one waits for the device on a GPU."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_micro_batch_metrics_are_summed_without_a_read_per_value(single_rank_ctx):
    from hybridflow.engine import _sum_metrics

    g = torch.Generator().manual_seed(0)
    outs = [{"actor/pg_loss": torch.randn((), generator=g), "actor/entropy": torch.rand(()),
             "actor/kl_loss": torch.rand((), dtype=torch.float64), "plain": 0.25 * i}
            for i in range(11)]
    with Reads() as reads:
        got = _sum_metrics(outs, single_rank_ctx)
    assert reads.n == 0
    assert sorted(got) == sorted(outs[0])
    for k in outs[0]:
        assert got[k] == pytest.approx(sum(float(o[k]) for o in outs), rel=1e-12, abs=1e-15)


def test_no_micro_batch_metrics_give_an_empty_dict(single_rank_ctx):
    from hybridflow.engine import _sum_metrics

    assert _sum_metrics([], single_rank_ctx) == {}
    assert _sum_metrics([{}], single_rank_ctx) == {}
