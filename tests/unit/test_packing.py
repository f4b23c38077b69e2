"""Sequence packing's host side (hybridflow.data.packing) and its attention
(hybridflow.models.attention.document_causal_mask / packed_attention) against padded references."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.data.batch import RolloutBatch
from hybridflow.data.packing import pack_rows
from hybridflow.models.attention import document_causal_mask, packed_attention

PROMPT_LENS, RESPONSE_LENS = [3, 1, 2], [2, 4, 1]


def _batch() -> RolloutBatch:
    p, r = max(PROMPT_LENS), max(RESPONSE_LENS)
    prompt_mask = (torch.arange(p)[None] >= p - torch.tensor(PROMPT_LENS)[:, None]).long()
    response_mask = (torch.arange(r)[None] < torch.tensor(RESPONSE_LENS)[:, None]).long()
    prompt_ids = (10 * torch.arange(1, 4)[:, None] + torch.arange(p)) * prompt_mask
    response_ids = (10 * torch.arange(1, 4)[:, None] + 5 + torch.arange(r)) * response_mask
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, group_ids=torch.arange(3),
                        indices=torch.arange(3))


@pytest.mark.parametrize("multiple", [1, 4])
def test_pack_rows_layout_and_gather(multiple):
    mb = _batch()
    pk = pack_rows(mb, multiple=multiple)
    real = sum(PROMPT_LENS) + sum(RESPONSE_LENS)  # 13
    s = -(-real // multiple) * multiple
    assert pk.input_ids.shape == (1, s) and pk.document_ids.shape == (s,)
    assert pk.input_ids[0, :real].tolist() == [10 * (j + 1) + c for j in range(3)
                                               for c in list(range(3 - PROMPT_LENS[j], 3))
                                               + [5 + k for k in range(RESPONSE_LENS[j])]]
    assert pk.document_ids.tolist() == [0] * 5 + [1] * 5 + [2] * 3 + [3] * (s - real)
    assert pk.position_ids[0, :real].tolist() == [0, 1, 2, 3, 4] * 2 + [0, 1, 2]
    assert pk.targets[0, :-1].tolist() == pk.input_ids[0, 1:].tolist()
    # the predicting position's target is the response token; entries past a response are 0
    pred = pk.unpack(pk.targets.float())
    torch.testing.assert_close(pred, mb.response_ids.float())
    own = pack_rows(mb, multiple=multiple, own_position=True)
    torch.testing.assert_close(own.unpack(own.input_ids.float()), mb.response_ids.float())


def test_unpack_is_differentiable():
    pk = pack_rows(_batch())
    x = torch.randn(1, pk.input_ids.shape[1], requires_grad=True)
    pk.unpack(x).sum().backward()
    assert x.grad.sum() == sum(RESPONSE_LENS)  # each gathered position once


@pytest.mark.parametrize("lengths", [[5, 7, 3, 1], [128, 128], [300, 17, 450, 1], [1000],
                                     [129, 127, 256, 2, 254, 1], [64] * 9])
def test_document_mask_blocks_equal_create_block_mask(lengths):
    """The block lists built from the documents' spans are those create_block_mask derives from
    the dense mask: partial and full blocks, per query block and (for the backward) per key block;
    lengths on and off the 128 grid, one document, many, a ragged last block."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    s = doc.numel()
    ours = document_causal_mask(doc)
    ref = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), None, None, s, s,
                            device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    for name, count in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks"),
                        ("q_indices", "q_num_blocks"), ("full_q_indices", "full_q_num_blocks")):
        n = getattr(ref, count)[0, 0]
        a, b = getattr(ours, name)[0, 0], getattr(ref, name)[0, 0]
        for row in range(n.shape[0]):  # the listed blocks; what follows them is never read
            assert torch.equal(a[row, :n[row]], b[row, :n[row]]), (name, row)
    assert ours.seq_lengths == (s, s)
    if max(lengths) >= 384:  # a document holding two whole blocks: a full pair exists, and the
        # kernel skips mask_mod there, so they must be right
        assert int(ours.full_kv_num_blocks.sum()) > 0


@pytest.mark.parametrize("lengths,grad", [([5, 7, 3, 1], False), ([5, 7, 3, 1], True),
                                          ([300, 17, 450, 1], False)],
                         ids=["flex_eager", "dense_fallback", "flex_eager_many_blocks"])
def test_packed_attention_equals_each_row_alone(lengths, grad):
    """[5, 7, 3, 1]: the last is SP tail padding, its own document; [300, 17, 450, 1]: full and
    partial 128-blocks and a ragged end."""
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    s, g = doc.numel(), torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, s, 8, generator=g, requires_grad=grad)
    k, v = (torch.randn(1, 2, s, 8, generator=g, requires_grad=grad) for _ in range(2))
    with torch.set_grad_enabled(grad):
        out = packed_attention(q, k, v, document_causal_mask(doc), scale=0.3)
    start = 0
    for n in lengths:  # each document alone, causal, GQA by expanded heads
        sl = slice(start, start + n)
        ref = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl].repeat_interleave(2, 1),
                                             v[:, :, sl].repeat_interleave(2, 1), is_causal=True,
                                             scale=0.3)
        torch.testing.assert_close(out[:, :, sl], ref, atol=1e-5, rtol=1e-5)
        start += n
    if grad:
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
