"""hybridflow.parallel.multi_tensor: Megatron's optimizer fallbacks (gradient norm, scale / copy)
with foreach kernels, against the fallbacks they replace, and without a host read per tensor."""
import pytest
import torch
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.parallel import multi_tensor


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a device value back to the host (`.item()`, `float(t)`)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (128,), (3, 4, 5), (1,), (64, 32)]
    return [torch.randn(s, generator=g) * (i + 1) for i, s in enumerate(shapes)]


def test_l2_norm_is_the_fallbacks_without_a_host_read_per_tensor(single_rank_ctx):
    grads, flag = _grads(), torch.zeros(1, dtype=torch.int)
    with _HostReads() as reads:
        total, per = multi_tensor.l2_norm(2048, flag, [grads], True)
    assert reads.count == 0
    ref, _ = mcore_utils.local_multi_tensor_l2_norm(2048, flag, [grads], False)
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total, ref.cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(per, torch.stack([g.norm() for g in grads]), rtol=1e-6, atol=0)
    # bf16 tensors' norms in fp32; none at all: a zero norm
    half = [g.bfloat16() for g in grads]
    total16, _ = multi_tensor.l2_norm(2048, flag, [half], False)
    torch.testing.assert_close(total16, torch.cat([h.float().flatten() for h in half]).norm()[None])
    zero, none = multi_tensor.l2_norm(2048, flag, [[]], True)
    assert zero.tolist() == [0.0] and none is None


def test_scale_in_place_copy_and_cast_match_the_fallback():
    flag = torch.zeros(1, dtype=torch.int)
    grads = _grads()
    ref = [g * 0.25 for g in grads]
    multi_tensor.scale(2048, flag, [grads, grads], 0.25)  # clipping: in place
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the main params into the model's (scale 1) and a scaled copy into another dtype, bit-equal to
    # the fallback's dst.copy_(src * scale)
    for factor in (1.0, 0.5):
        main = _grads(1)
        ours = [torch.empty_like(m, dtype=torch.bfloat16) for m in main]
        theirs = [torch.empty_like(m, dtype=torch.bfloat16) for m in main]
        multi_tensor.scale(2048, flag, [main, ours], factor)
        mcore_utils.local_multi_tensor_scale(2048, flag, [main, theirs], factor)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    multi_tensor.scale(2048, flag, [[], []], 2.0)  # nothing to do


def test_install_replaces_only_the_fallbacks_and_megatron_reads_the_norm_once(single_rank_ctx,
                                                                            monkeypatch):
    for module in (clip_grads, mcore_optimizer):
        monkeypatch.setattr(module, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
    monkeypatch.setattr(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
    multi_tensor.install()
    multi_tensor.install()  # idempotent
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_impl is mcore_optimizer.multi_tensor_scale_impl \
        is multi_tensor.scale
    grads = _grads()
    with _HostReads() as reads:
        norm = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=None)
    assert reads.count == 1  # the total, after its all-reduce
    assert norm == pytest.approx(float(torch.cat([g.flatten() for g in grads]).norm()), rel=1e-6)
    # apex's or transformer-engine's kernels, where Megatron found them, stay
    kernel = object()
    monkeypatch.setattr(clip_grads, "l2_norm_impl", kernel)
    monkeypatch.setattr(mcore_optimizer, "multi_tensor_scale_impl", kernel)
    multi_tensor.install()
    assert clip_grads.l2_norm_impl is kernel and mcore_optimizer.multi_tensor_scale_impl is kernel


def _train(ctx, precision):
    from hybridflow.config import ModelConfig, OptimConfig, ParallelConfig
    from hybridflow.engine import Engine
    from tests.dist.test_parallel_parity import _global_batch
    from tests.unit.test_optimizer_offload import _loss

    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                        num_query_groups=2, vocab_size=50)
    torch.manual_seed(0)
    # clip_grad small enough that every step clips (the in-place scale runs)
    eng = Engine(role="actor", model_cfg=model, ctx=ctx, parallel=ParallelConfig(),
                 precision=precision, optim=OptimConfig(lr=1e-2, clip_grad=1e-3))
    norms = [eng.train_step(_global_batch(), _loss, micro_batch_size=4)["grad_norm"]
             for _ in range(2)]
    return {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}, norms


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_updates_equal_the_fallbacks_ones(single_rank_ctx, monkeypatch, precision):
    ours, our_norms = _train(single_rank_ctx, precision)
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    with monkeypatch.context() as m:
        m.setattr(multi_tensor, "install", lambda: None)
        m.setattr(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
        for module in (clip_grads, mcore_optimizer):
            m.setattr(module, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
        theirs, their_norms = _train(single_rank_ctx, precision)
    assert our_norms == pytest.approx(their_norms, rel=1e-5) and our_norms[0] > 1e-3
    # the norms' last bits may differ (another summation order): fp32 weights to fp32 rounding,
    # bf16 ones to one bf16 step
    tol = dict(rtol=1e-5, atol=1e-7) if precision == "fp32" else dict(rtol=8e-3, atol=1e-6)
    for n, w in theirs.items():
        torch.testing.assert_close(ours[n], w, **tol, msg=n)
