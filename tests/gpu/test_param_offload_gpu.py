"""actor.offload_params on a GPU: the host copies are pinned; offloading frees the weights' device
memory and a prefetch (side stream) holds it again from the call; updates with the weights moved
out and prefetched back between steps equal updates without (bf16, bit for bit); a quantized
generator built from the host one matrix at a time holds the codes of one built in place while
the device never holds all the bf16 matrices beside the codes."""

import dataclasses

import pytest
import torch

from hybridflow.config import LoRAConfig, OptimConfig, ParallelConfig, RolloutConfig
from tests.dist.test_parallel_parity import _global_batch
from tests.unit.test_optimizer_offload import MODEL, _loss

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _engine(ctx, offload: bool, lora):
    from hybridflow.engine import Engine
    from tests.dist.parity_util import fill_deterministic

    torch.manual_seed(0)
    eng = Engine(role="actor", model_cfg=MODEL, ctx=ctx, parallel=ParallelConfig(),
                 precision="bf16", optim=OptimConfig(lr=1e-2), lora=lora,
                 offload_params=offload)
    fill_deterministic(eng.module, num_layers=MODEL.num_layers)
    eng.optimizer.reload_model_params()
    return eng


@pytest.mark.parametrize("lora", [None, LoRAConfig(rank=4, alpha=8.0)], ids=["full", "lora"])
def test_prefetched_weights_train_as_resident_ones(single_rank_ctx, lora):
    plain, moved = _engine(single_rank_ctx, False, lora), _engine(single_rank_ctx, True, lora)
    off = moved._param_offload
    assert off.nbytes > 0
    for _ in range(2):
        plain.train_step(_global_batch(), _loss, micro_batch_size=4)
        moved.train_step(_global_batch(), _loss, micro_batch_size=4)
        held = torch.cuda.memory_allocated()
        moved.params_to_host()
        assert all(h.is_pinned() for h in off._host)
        assert held - torch.cuda.memory_allocated() >= off.nbytes  # freed
        moved.params_to_device(prefetch=True)
        assert torch.cuda.memory_allocated() >= held  # held again from the call on
    for (n, a), b in zip(plain.module.named_parameters(), moved.module.parameters()):
        assert torch.equal(a, b), n


def test_streamed_quantization_equals_in_place():
    from hybridflow.offload import ParamOffload
    from hybridflow.rollout import Generator
    from hybridflow.rollout.options import DecodeOptions
    from hybridflow.rollout.quantize import MATRIX_LINEARS
    from tests.unit.test_quantized_rollout import QCFG
    from tests.unit.test_rollout import PROMPTS, random_params

    cfg = dataclasses.replace(QCFG, num_layers=8)  # one matrix is small beside all of them
    params = {k: v.cuda().bfloat16() for k, v in random_params(cfg).items()}
    kw = dict(model_cfg=cfg, tp_group=None, device=torch.device("cuda"), dtype=torch.bfloat16,
              true_vocab_size=cfg.vocab_size, quantization="fp8")
    rc = RolloutConfig(max_new_tokens=8, temperature=0.0, return_logprobs=True)
    opts = DecodeOptions.from_config(rc).replace(cuda_graphs=False)
    want = Generator(params=params, **kw).generate(PROMPTS, cfg=rc, eos_id=36, pad_id=0, seed=0,
                                                   options=opts)
    suffixes = tuple(f".{p}.weight" for p in MATRIX_LINEARS.values())
    matrices = [t for n, t in params.items() if n.endswith(suffixes)]
    off = ParamOffload(list(params.values()), device="cuda", frozen=True)
    off.to_host(keep=frozenset(t.untyped_storage().data_ptr() for n, t in params.items()
                               if not n.endswith(suffixes)))
    assert all(t.untyped_storage().nbytes() == 0 for t in matrices)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gen = Generator(params={n: off.host_view(t) for n, t in params.items()},
                    fetch=lambda i, f, t: t.to("cuda", non_blocking=True), **kw)
    bf16 = sum(t.numel() * 2 for t in matrices)
    assert torch.cuda.max_memory_allocated() - base < gen.quantized_bytes + bf16 / 2
    got = gen.generate(PROMPTS, cfg=rc, eos_id=36, pad_id=0, seed=0, options=opts)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.rollout_logprobs, want.rollout_logprobs)
