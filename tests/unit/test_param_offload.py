"""ParamOffload (actor.offload_params) on CPU: storages leave (0 bytes) and come back bit for bit;
views into one buffer (a distributed optimizer's parameter buffer) move as one storage; `keep`
leaves storages on the device; the host copy is refreshed only after `mark_changed` (a frozen LoRA
base's never is). The device here is the CPU: "host" is a second buffer."""

import torch

from hybridflow.offload import ParamOffload


def _params():
    buf = torch.randn(30)
    views = [torch.nn.Parameter(buf[:10].view(2, 5)), torch.nn.Parameter(buf[10:].view(4, 5))]
    views[0].data, views[1].data = buf[:10].view(2, 5), buf[10:].view(4, 5)  # share `buf`
    own = torch.nn.Parameter(torch.randn(3, 3))
    return views + [own]


def test_round_trip_views_and_keep():
    params = _params()
    before = [p.detach().clone() for p in params]
    off = ParamOffload(params, device="cpu", frozen=False)
    assert off.nbytes == 30 * 4 + 9 * 4  # the shared buffer counted once
    off.to_host()
    assert all(p.untyped_storage().nbytes() == 0 for p in params) and off.away_bytes() == off.nbytes
    off.to_device()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    keep = frozenset({params[2].untyped_storage().data_ptr()})
    off.to_host(keep)
    assert params[0].untyped_storage().nbytes() == 0 and torch.equal(params[2], before[2])
    off.to_device()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_host_copy_refreshed_only_after_a_change():
    params = _params()
    for frozen in (True, False):
        off = ParamOffload(params, device="cpu", frozen=frozen)
        off.to_host()
        off.to_device()
        with torch.no_grad():
            params[2].add_(1.0)  # as an optimizer step would
        now = params[2].detach().clone()
        off.mark_changed()
        off.to_host()
        off.to_device()
        # a frozen base never changes: its first host copy comes back (nothing copied again)
        assert torch.equal(params[2], now) != frozen


def test_streamed_quantization_equals_in_place():
    """A quantized generator built from host copies one matrix at a time (`fetch`) holds the codes
    of one built in place: the same tokens and log-probs."""
    from hybridflow.config import RolloutConfig
    from hybridflow.rollout import Generator
    from hybridflow.rollout.options import DecodeOptions
    from hybridflow.rollout.quantize import MATRIX_LINEARS
    from tests.unit.test_quantized_rollout import QCFG
    from tests.unit.test_rollout import PROMPTS, random_params

    params = random_params(QCFG)
    kw = dict(model_cfg=QCFG, tp_group=None, device=torch.device("cpu"), dtype=torch.float32,
              true_vocab_size=QCFG.vocab_size, quantization="fp8")
    rc = RolloutConfig(max_new_tokens=6, temperature=0.0, return_logprobs=True)
    opts = DecodeOptions.from_config(rc)
    run = dict(cfg=rc, eos_id=36, pad_id=0, seed=0, options=opts)
    want = Generator(params=params, **kw).generate(PROMPTS, **run)
    suffixes = tuple(f".{p}.weight" for p in MATRIX_LINEARS.values())
    off = ParamOffload(list(params.values()), device="cpu", frozen=True)
    off.to_host(keep=frozenset(t.untyped_storage().data_ptr() for n, t in params.items()
                               if not n.endswith(suffixes)))
    away = [t for n, t in params.items() if n.endswith(suffixes)]
    assert away and all(t.untyped_storage().nbytes() == 0 for t in away)
    fetched = []
    gen = Generator(params={n: off.host_view(t) for n, t in params.items()},
                    fetch=lambda i, f, t: fetched.append((i, f)) or t.clone(), **kw)
    assert len(fetched) == len(away)
    got = gen.generate(PROMPTS, **run)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.rollout_logprobs, want.rollout_logprobs)
