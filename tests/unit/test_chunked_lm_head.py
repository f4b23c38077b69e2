"""parallel.lm_head_chunk_tokens: the LM head + log-prob pass in chunks of positions
(chunked_linear_logprobs) gives the log-probs, entropy and the gradients of the hidden states, the
weight and a bias that the whole-logits path gives (F.linear, then vocab_parallel_logprobs), for
chunks of 1 position, uneven chunks, one chunk, and a chunk larger than the input; with a padded
vocabulary and a temperature. The TP = 2 case: tests/dist/test_logprob_tp.py."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.models.logprob import chunked_linear_logprobs, vocab_parallel_logprobs

N, H, V_PAD, V_TRUE, TEMP = 11, 8, 24, 21, 0.7


def _data(bias: bool):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=torch.float32)
    w = torch.randn(V_PAD, H, generator=g, dtype=torch.float32)
    b = torch.randn(V_PAD, generator=g, dtype=torch.float32) if bias else None
    targets = torch.randint(0, V_TRUE, (N,), generator=g)
    weights = torch.randn(2, N, generator=g, dtype=torch.float32)
    return h, w, b, targets, weights


def _run(fn, bias):
    h, w, b, targets, weights = _data(bias)
    leaves = [t.requires_grad_() for t in (h, w, b) if t is not None]
    lp, ent = fn(h, w, b, targets)
    ((weights[0] * lp).sum() + (weights[1] * ent).sum()).backward()
    return [lp.detach(), ent.detach()] + [t.grad for t in leaves]


def _whole(h, w, b, targets):
    logits = F.linear(h, w, b)[None]
    lp, ent = vocab_parallel_logprobs(logits, targets[None], tp_group=None,
                                      true_vocab_size=V_TRUE, temperature=TEMP, with_entropy=True,
                                      impl="torch")
    return lp[0], ent[0]


@pytest.mark.parametrize("chunk", [1, 4, N, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_whole_logits(chunk, bias):
    ref = _run(_whole, bias)
    out = _run(lambda h, w, b, t: chunked_linear_logprobs(
        h, w, t, tp_group=None, true_vocab_size=V_TRUE, temperature=TEMP, with_entropy=True,
        chunk_tokens=chunk, bias=b), bias)
    for name, a, r in zip(["logprobs", "entropy", "grad h", "grad w", "grad b"], out, ref):
        torch.testing.assert_close(a, r, msg=name)


def test_logprobs_only_and_no_grad():
    h, w, _, targets, _ = _data(False)
    with torch.no_grad():
        lp = chunked_linear_logprobs(h, w, targets, tp_group=None, true_vocab_size=V_TRUE,
                                     chunk_tokens=3)
    ref = torch.log_softmax(F.linear(h, w)[:, :V_TRUE], -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, ref)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_linear_logprobs(h, w, targets, tp_group=None, true_vocab_size=V_TRUE,
                                chunk_tokens=0)
