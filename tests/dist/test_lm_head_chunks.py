"""parallel.lm_head_chunk_tokens (the LM head + log-prob pass a few positions at a time, logits
recomputed in backward) gives the results of the whole-logits pass, through the real Engine.

The batch of test_dynamic_bsz runs through fresh engines with chunks of 3 positions and without
(the launch of tests/dist/test_activation_checkpointing.py, shared), fixed / token-budget / packed
micro-batches, one rank and TP = 2 with sequence parallel (the vocab-parallel statistics are
combined over TP as the whole-logits kernels combine them). Compared, fp32: log-probs, entropies,
values, one actor train step (metrics, every gradient, the weights after Adam). The memory side:
autograd holds no (positions x vocab) tensor for backward."""

import pytest

from tests.dist.test_activation_checkpointing import LAYOUTS, MODES, variant_results
from tests.dist.test_dynamic_bsz import MODEL, _batch, assert_same_results


@LAYOUTS
def test_chunked_lm_head_gives_the_same_results(world, tp, sp):
    for res in variant_results(world, tp, sp):
        for mode in MODES:
            assert_same_results(res[mode, "lm_chunk"], res[mode, "plain"], res["mask"], atol=1e-6)
        if tp == 1:  # the whole pass keeps the (positions x vocab) logits; chunks keep none
            b, r = _batch().response_ids.shape
            assert res["vocab_wide", "plain"] >= b * r * MODEL.vocab_size
            assert res["vocab_wide", "lm_chunk"] == 0


def test_negative_chunk_is_an_error():
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    with pytest.raises(ValueError, match=r"parallel.lm_head_chunk_tokens=-1: expected 0 \(off\)"):
        validate(load_config(["experiment=demo", "parallel.lm_head_chunk_tokens=-1"]), world_size=1)
