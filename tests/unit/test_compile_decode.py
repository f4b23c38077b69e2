"""rollout.compile_decode on CPU: the decode step with each layer's two pure parts traced by
torch.compile (dynamo with the aot_eager backend: inductor's CPU kernels take minutes to build
here; tests/gpu/test_rollout_gpu.py runs inductor under CUDA graphs) generates what the eager step
generates, with the options it runs beside on a GPU (windows, compaction, sampling), two traces
for every batch bucket, window and layer; and a clear error where it does not apply (TP_g > 1)."""

import dataclasses

import pytest
import torch

from hybridflow.rollout import decoder, sampling
from tests.unit.test_rollout import PROMPTS, make, opts, rc


def traces(*fns) -> dict:
    """name -> dynamo traces (cache entries) of each compiled function: unrelated compiles
    elsewhere in the process cannot change them (tests/gpu counts the same way)."""
    return {fn.__name__: len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))
            for fn in fns}


def test_compiled_decode_generates_what_eager_does():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = make()
    cfg = rc(n=3, temperature=1.0, max_new_tokens=150, compact_finished_rows=True,
             decode_kv_window=64)
    ref = gen.generate(PROMPTS, cfg=cfg, eos_id=5, pad_id=0, seed=1,
                       options=opts(cfg, check_every=4))
    compiled = opts(cfg, check_every=4, compile=True, compile_backend="aot_eager")
    out = gen.generate(PROMPTS, cfg=cfg, eos_id=5, pad_id=0, seed=1, options=compiled)
    assert gen.stats["compactions"] > 0  # several batch sizes and windows went through it
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    torch.testing.assert_close(out.rollout_logprobs, ref.rollout_logprobs, atol=1e-5, rtol=1e-5)
    # each compiled function traced once for every batch size >= 2 and once for 1 (dynamo
    # specialises sizes 0/1; compaction reaches a 1-row bucket with this seed), a layer's first
    # part also with and without the previous MLP output to add (layer 0): not per bucket, window
    # or layer
    entries = traces(decoder._attn_in, decoder._attn_out_split, sampling._race_argmax,
                     sampling._token_logprobs)
    assert entries == {"_attn_in": 4, "_attn_out_split": 2, "_race_argmax": 2,
                       "_token_logprobs": 2}, (entries, torch._dynamo.utils.counters["stats"])


def test_compiled_decode_needs_generation_tp_1():
    gen = make()
    gen.w = dataclasses.replace(gen.w, dims=dataclasses.replace(gen.w.dims, tp_size=2))
    with pytest.raises(ValueError, match="rollout.compile_decode=true needs a generation TP of 1"):
        gen.generate(PROMPTS, cfg=rc(compile_decode=True), eos_id=5, pad_id=0, seed=0)
