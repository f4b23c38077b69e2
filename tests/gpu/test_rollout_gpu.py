"""Generator on a GPU: CUDA-graph decode == eager decode == the CPU path; buckets and chunking;
asynchronous early exit; row compaction under graphs (== uncompacted, == CPU); seeded sampling under
graphs; release() gives the memory back."""

import dataclasses

import pytest
import torch

from hybridflow.config import RolloutConfig
from hybridflow.rollout import Generator
from hybridflow.rollout.options import DecodeOptions
from tests.unit.test_rollout import CFG, PROMPTS, random_params

pytestmark = pytest.mark.gpu


def _torch_path(**kw) -> RolloutConfig:
    """The PyTorch decode path (rollout.decode_kernels=auto would take the Triton kernels here)."""
    return RolloutConfig(decode_kernels="torch", **kw)


def _gen(device):
    return Generator(model_cfg=CFG, params=random_params(CFG), tp_group=None,
                     device=torch.device(device), dtype=torch.float32,
                     true_vocab_size=CFG.vocab_size)


def _polled(gen):
    """gen.generate with stop polls every 2 steps and graphed compaction buckets down to 1 row
    (this test's tiny batches)."""
    def generate(prompts, *, cfg, **kw):
        options = DecodeOptions.from_config(cfg).replace(check_every=2, min_graphed_bucket=1)
        return gen.generate(prompts, cfg=cfg, options=options, **kw)
    return generate


def test_graphs_match_eager_and_cpu():
    cpu, gpu = _gen("cpu"), _gen("cuda")
    free = cpu.generate(PROMPTS, cfg=_torch_path(max_new_tokens=12, temperature=0.0),
                        eos_id=-1, pad_id=0, seed=0).response_ids
    cfg = _torch_path(max_new_tokens=12, temperature=0.0, n=2, max_batch_size=3,
                        return_logprobs=True, stop_token_ids=[int(free[1, 5])])
    eos = int(free[0, 3])
    ref = cpu.generate(PROMPTS, cfg=cfg, eos_id=eos, pad_id=0, seed=0)
    graphed = gpu.generate(PROMPTS, cfg=cfg, eos_id=eos, pad_id=0, seed=0)  # buckets 3 and 2
    eager = gpu.generate(PROMPTS, cfg=dataclasses.replace(cfg, cuda_graphs=False), eos_id=eos,
                         pad_id=0, seed=0)
    assert torch.equal(graphed.response_ids, eager.response_ids)
    assert torch.equal(graphed.response_ids.cpu(), ref.response_ids)
    assert torch.equal(graphed.response_mask.cpu(), ref.response_mask)
    assert torch.allclose(graphed.rollout_logprobs.cpu(), ref.rollout_logprobs, atol=1e-4)
    assert (ref.response_mask.sum(1) < 12).any()


def test_early_exit_on_gpu():
    gen = _gen("cuda")
    free = _polled(gen)(PROMPTS, cfg=_torch_path(max_new_tokens=4, temperature=0.0),
                        eos_id=-1, pad_id=0, seed=0).response_ids
    out = _polled(gen)(PROMPTS, cfg=_torch_path(max_new_tokens=100, temperature=0.0,
                                                  stop_token_ids=free[:, 1].tolist()),
                       eos_id=-1, pad_id=0, seed=0)
    assert out.response_ids.shape[1] <= 2
    buf, _ = next(v for k, v in gen._steps.items() if k[1] == 100)
    assert int(buf.step) <= 1 + 3 * 2


def test_seeded_sampling_under_graphs_and_release():
    before = torch.cuda.memory_allocated()
    gen = _gen("cuda")
    weights = torch.cuda.memory_allocated() - before
    cfg = _torch_path(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9, n=4)
    a = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=11)
    b = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=11)
    c = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=12)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert a.response_ids.max() < CFG.vocab_size
    assert torch.cuda.memory_allocated() > before + weights  # cache and graph pool held
    gen.release()
    assert torch.cuda.memory_allocated() <= before + weights  # (cuBLAS workspaces freed too)


def test_compaction_under_graphs():
    from tests.unit.test_compaction import random_prompts, uneven_stops

    cpu, gpu = _gen("cpu"), _gen("cuda")
    prompts, R = random_prompts(24, vocab=CFG.vocab_size), 40
    free = _polled(cpu)(prompts, cfg=_torch_path(max_new_tokens=R, temperature=0.0),
                        eos_id=-1, pad_id=0, seed=0).response_ids
    stops = uneven_stops(free, [0, 5, 14], CFG.vocab_size)
    cfg = _torch_path(max_new_tokens=R, temperature=0.0, max_batch_size=20,
                        return_logprobs=True, stop_token_ids=stops,
                        compact_finished_rows=True)  # chunks 20 and 4
    on = _polled(gpu)(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0)
    assert gpu.stats["compactions"] >= 1
    off = _polled(gpu)(prompts, cfg=dataclasses.replace(cfg, compact_finished_rows=False),
                       eos_id=-1, pad_id=0, seed=0)
    ref = _polled(cpu)(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0)
    for other in (off, ref):
        assert torch.equal(on.response_ids.cpu(), other.response_ids.cpu())
        assert torch.equal(on.response_mask.cpu(), other.response_mask.cpu())
        assert torch.allclose(on.rollout_logprobs.cpu(), other.rollout_logprobs.cpu(), atol=1e-4)
    sampled = dataclasses.replace(cfg, temperature=1.0, top_p=0.95, stop_token_ids=stops[:6])
    a = _polled(gpu)(prompts, cfg=sampled, eos_id=-1, pad_id=0, seed=3)
    assert gpu.stats["compactions"] >= 1
    b = _polled(gpu)(prompts, cfg=sampled, eos_id=-1, pad_id=0, seed=3)
    assert torch.equal(a.response_ids, b.response_ids)


def test_decode_windows_under_graphs():
    """rollout.decode_kv_window: a graph per window and bucket (with compaction), the same greedy
    output as the whole-cache graphs and the CPU path; the generator kept for a second call (as
    rollout.free_cache_engine=false does) replays the same graphs."""
    from tests.unit.test_compaction import random_prompts, uneven_stops

    cpu, gpu = _gen("cpu"), _gen("cuda")
    prompts, R = random_prompts(24, vocab=CFG.vocab_size), 150  # cache 192 columns (or more)
    free = _polled(cpu)(prompts, cfg=_torch_path(max_new_tokens=R, temperature=0.0),
                        eos_id=-1, pad_id=0, seed=0).response_ids
    stops = uneven_stops(free, [0, 5, 14], CFG.vocab_size)
    cfg = _torch_path(max_new_tokens=R, temperature=0.0, max_batch_size=20, return_logprobs=True,
                        stop_token_ids=stops[:2], compact_finished_rows=True)
    whole = _polled(gpu)(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0)
    windowed = dataclasses.replace(cfg, decode_kv_window=64)
    first = _polled(gpu)(prompts, cfg=windowed, eos_id=-1, pad_id=0, seed=0)
    captured = len(gpu._steps)
    again = _polled(gpu)(prompts, cfg=windowed, eos_id=-1, pad_id=0, seed=0)
    assert len(gpu._steps) == captured  # nothing re-captured
    ref = _polled(cpu)(prompts, cfg=windowed, eos_id=-1, pad_id=0, seed=0)
    for other in (first, again, ref):
        assert torch.equal(whole.response_ids.cpu(), other.response_ids.cpu())
        assert torch.allclose(whole.rollout_logprobs.cpu(), other.rollout_logprobs.cpu(),
                              atol=1e-4)


def test_compiled_decode_under_graphs():
    """rollout.compile_decode: each layer's inductor-compiled parts, captured per bucket and window,
    give the eager graphs' greedy output (fp32, so fusion's reordering stays below any argmax
    margin), compiled once across buckets, windows and layers."""
    from tests.unit.test_compaction import random_prompts, uneven_stops

    torch._dynamo.reset()  # traces are counted per function: none from earlier tests (bf16 ones)
    torch._dynamo.utils.counters.clear()
    gpu = _gen("cuda")
    prompts, R = random_prompts(24, vocab=CFG.vocab_size), 150
    free = _polled(gpu)(prompts, cfg=_torch_path(max_new_tokens=R, temperature=0.0),
                        eos_id=-1, pad_id=0, seed=0).response_ids
    stops = uneven_stops(free.cpu(), [0, 5, 14], CFG.vocab_size)
    cfg = _torch_path(max_new_tokens=R, temperature=0.0, max_batch_size=20, return_logprobs=True,
                        stop_token_ids=stops[:2], compact_finished_rows=True, decode_kv_window=64)
    eager = _polled(gpu)(prompts, cfg=cfg, eos_id=-1, pad_id=0, seed=0)
    compiled = _polled(gpu)(prompts, cfg=dataclasses.replace(cfg, compile_decode=True), eos_id=-1,
                            pad_id=0, seed=0)
    assert torch.equal(eager.response_ids, compiled.response_ids)
    assert torch.allclose(eager.rollout_logprobs, compiled.rollout_logprobs, atol=1e-4)
    from hybridflow.rollout import decoder, sampling
    from tests.unit.test_compile_decode import traces
    entries = traces(decoder._attn_in, decoder._attn_out_split, sampling._token_logprobs)
    print(f"compiled decode: traces per function {entries}")
    # per function: batch >= 2, and batch 1 where compaction reaches it; a layer's first part also
    # with and without the previous MLP output to add. Not per bucket, window or layer
    bounds = {"_attn_in": 4, "_attn_out_split": 2, "_token_logprobs": 2}
    assert all(1 <= entries[k] <= n for k, n in bounds.items()), entries
