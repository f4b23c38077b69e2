"""DecodeOptions (hybridflow/rollout/options.py): built from the rollout config's keys, checked with
errors that name the key, and part of the key of the generator's captured decode steps (a call
with other options never reuses another's steps; the same options do)."""

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.config_checks import validate, validate_rollout_options
from hybridflow.rollout.options import DecodeOptions
from tests.unit.test_rollout import PROMPTS, make, opts, rc


def test_from_config_reads_the_rollout_keys():
    cfg = load_config(["experiment=demo", "rollout.decode_kernels=torch",
                       "rollout.compile_decode=true", "rollout.decode_kv_window=128",
                       "rollout.compact_finished_rows=true", "rollout.cuda_graphs=false",
                       "rollout.kernel_options.pdl=false",
                       "rollout.kernel_options.prefetch_weights=[proj,fc1,qkv]",
                       "rollout.kernel_options.prefetch_min_rows=64",
                       "rollout.kernel_options.swiglu_gemm_min_rows=0",
                       "rollout.kernel_options.compile_backend=aot_eager",
                       "rollout.kernel_options.own_columns_only=false",
                       "rollout.kernel_options.prefill_width_multiple=32"])
    o = DecodeOptions.from_config(cfg.rollout)
    assert (o.kernels, o.compile, o.kv_window, o.compact_finished_rows, o.cuda_graphs) == (
        "torch", True, 128, True, False)
    assert (o.pdl, o.prefetch_weights, o.prefetch_min_rows, o.swiglu_gemm_min_rows) == (
        False, ("qkv", "proj", "fc1"), 64, 0)  # one order whatever the config's
    assert o.compile_backend == "aot_eager" and o.compile_mode is None
    assert not o.own_columns_only and DecodeOptions().own_columns_only
    assert o.prefill_width_multiple == 32
    # the defaults: the config's kernel options are the options' own
    assert DecodeOptions.from_config(rc()) == DecodeOptions(kernels="auto")
    assert hash(o) != hash(o.replace(pdl=True))


@pytest.mark.parametrize("override,match", [
    ("rollout.kernel_options.prefetch_weights=[qkv,fc3]",
     "rollout.kernel_options.prefetch_weights: 'fc3' is not one of qkv, proj, fc1, fc2"),
    ("rollout.kernel_options.prefetch_min_rows=-1",
     "rollout.kernel_options.prefetch_min_rows: -1 is not a row count"),
    ("rollout.kernel_options.swiglu_gemm_min_rows=-8",
     "rollout.kernel_options.swiglu_gemm_min_rows"),
    ("rollout.kernel_options.compile_mode=fastest", "rollout.kernel_options.compile_mode"),
    ("rollout.kernel_options.prefill_width_multiple=0",
     "rollout.kernel_options.prefill_width_multiple: 0 is not null or a column count"),
    ("rollout.decode_kernels=cuda", "rollout.decode_kernels: 'cuda' is not one of"),
])
def test_validation_names_the_key(override, match):
    cfg = load_config(["experiment=demo", override])
    with pytest.raises(ValueError, match=match.replace("(", "\\(")):
        validate_rollout_options(cfg)
    validate_rollout_options(load_config(["experiment=demo"]))
    validate_rollout_options(load_config(["experiment=demo"]).rollout)
    with pytest.raises(ValueError, match=match.replace("(", "\\(")):
        validate(cfg, world_size=1)  # part of the config checks, before anything is built


def test_options_key_the_captured_steps():
    """Two DecodeOptions that differ (here in launch options the torch path does not read) keep
    two sets of steps, so a graph captured under one is never replayed under the other; the same
    options again reuse theirs."""
    gen = make()
    cfg = rc(max_new_tokens=6)
    a, b = opts(cfg, pdl=True), opts(cfg, pdl=False, prefetch_weights=("fc2",))
    out_a = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=a)
    keys = set(gen._steps)
    gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=b)
    added = set(gen._steps) - keys
    assert len(keys) == 1 and len(added) == 1
    (ka,), (kb,) = keys, added
    oa, ob = (next(x for x in k if isinstance(x, DecodeOptions)) for k in (ka, kb))
    assert ka != kb and oa.pdl and not ob.pdl  # the options (resolved) are part of the key
    assert oa.kernels == ob.kernels == "torch"  # "auto" decided for the CPU
    again = gen.generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0, options=a)
    assert len(gen._steps) == 2 and torch.equal(again.response_ids, out_a.response_ids)
