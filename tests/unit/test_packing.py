"""Sequence packing's host side (hybridflow.data.packing) and its attention
(hybridflow.models.attention: document_causal_mask / packed_attention, the documents' cu_seqlens for
the varlen kernel, the kernel's choice) against padded references."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.data.batch import RolloutBatch
from hybridflow.data.packing import PackedShape, fit_packed, pack_rows, shape_for
from hybridflow.models import attention
from hybridflow.models.attention import (choose_packed_attention, document_causal_mask,
                                        packed_attention, packed_documents)

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


def test_unpack_scored_places_each_result_and_its_gradient_as_a_mask_scatter_does():
    pk = pack_rows(_batch())
    n = int(pk.valid.sum())
    assert pk.slots.tolist() == pk.valid.flatten().nonzero().squeeze(1).tolist()
    x = torch.randn(1, n, requires_grad=True)
    ref = torch.zeros(pk.valid.shape).masked_scatter(pk.valid, x[0])
    out = pk.unpack_scored(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    w = torch.randn(pk.valid.shape)
    (gx,) = torch.autograd.grad((out * w).sum(), x)
    torch.testing.assert_close(gx[0], w[pk.valid], rtol=0, atol=0)
    # the slots come with the row through a fit to a static shape
    fitted = fit_packed(pk, PackedShape(length=32, documents=8, max_seqlen=16))
    assert fitted.slots is pk.slots


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


def _ragged_batch(prompts, responses, seed=0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(prompts), max(prompts), max(max(responses), 1)
    prompt_mask = (torch.arange(p)[None] >= p - torch.tensor(prompts)[:, None]).long()
    response_mask = (torch.arange(r)[None] < torch.tensor(responses)[:, None]).long()
    return RolloutBatch(prompt_ids=torch.randint(1, 50, (b, p), generator=g) * prompt_mask,
                        prompt_mask=prompt_mask,
                        response_ids=torch.randint(1, 50, (b, r), generator=g) * response_mask,
                        response_mask=response_mask, group_ids=torch.arange(b),
                        indices=torch.arange(b))


@pytest.mark.parametrize("prompts,responses,multiple", [
    (PROMPT_LENS, RESPONSE_LENS, 1),     # no tail: the documents are the rows
    (PROMPT_LENS, RESPONSE_LENS, 4),     # a tail of 3: one more document
    ([1], [0], 8),                       # one token, then a tail of 7
    ([105, 97, 130, 1], [300, 1, 1024, 0], 1),  # GSM8K-like, off the 128 grid, a 1-token row
    ([60, 68], [4, 4], 128),             # 128 real tokens: a multiple of 128 leaves no tail
    ([5, 0, 3], [2, 0, 1], 2),           # a row without tokens: no document of its own
])
def test_packed_metadata_equals_the_row_documents(prompts, responses, multiple):
    """cu_seqlens / max_seqlen (what varlen_attn reads) are the runs of document_ids (what the
    flex mask reads): each non-empty row, then the tail padding."""
    pk = pack_rows(_ragged_batch(prompts, responses), multiple=multiple)
    s = pk.input_ids.shape[1]
    ids, counts = torch.unique_consecutive(pk.document_ids, return_counts=True)
    want = [p + r for p, r in zip(prompts, responses) if p + r]
    if s > sum(want):
        want.append(s - sum(want))
    assert counts.tolist() == want and s % multiple == 0
    assert pk.cu_seqlens.dtype == torch.int32
    assert pk.cu_seqlens.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    assert pk.cu_seqlens[-1] == s and pk.max_seqlen == max(want)
    for i in range(len(want)):  # each span holds exactly one document id
        span = pk.document_ids[pk.cu_seqlens[i]:pk.cu_seqlens[i + 1]]
        assert (span == ids[i]).all()
    dev = pk.to("cpu")  # tensors move, the host int stays
    assert dev.max_seqlen == pk.max_seqlen and torch.equal(dev.cu_seqlens, pk.cu_seqlens)


def test_packed_documents_build_the_mask_only_for_flex():
    pk = pack_rows(_batch(), multiple=4)
    flex = packed_documents(pk.document_ids, pk.cu_seqlens, pk.max_seqlen, kernel="flex")
    ref = document_causal_mask(pk.document_ids)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(flex.block_mask, name), getattr(ref, name)), name
    varlen = packed_documents(pk.document_ids, pk.cu_seqlens, pk.max_seqlen, kernel="varlen")
    assert varlen.block_mask is None and varlen.max_seqlen == 5
    assert torch.equal(varlen.cu_seqlens, pk.cu_seqlens)
    with pytest.raises(ValueError, match="'sdpa' is not one of"):
        packed_documents(pk.document_ids, pk.cu_seqlens, pk.max_seqlen, kernel="sdpa")


def test_sdpattention_runs_packed_documents_on_flex_on_cpu():
    """The layer's packed branch ([s, 1, h, d] in, [s, 1, h * d] out) with the CPU fallback kernel:
    each document attends causally within itself, as it would alone (GQA 4 / 2 heads)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hybridflow.models.attention import SDPAttention

    lengths = [5, 1, 9, 3]
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, kv_channels=8)
    layer = SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                         attention_type="self").eval()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(18, 1, 4, 8, generator=g)
    k, v = (torch.randn(18, 1, 2, 8, generator=g) for _ in range(2))
    out = layer(q, k, v, packed_documents(doc, cu, 9, kernel="flex"))
    assert out.shape == (18, 1, 32)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].permute(1, 2, 0, 3) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True,
                                             scale=8 ** -0.5)
        torch.testing.assert_close(out[a:b], ref.permute(2, 0, 1, 3).reshape(b - a, 1, 32),
                                   atol=1e-5, rtol=1e-5)


def test_kernel_choice_falls_back_to_flex_and_says_why():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kernel, line = choose_packed_attention("auto", device=cpu, dtype=torch.bfloat16, head_dim=64)
    assert kernel == "flex"
    assert line == ("packed attention: flex_attention document mask (algo.packed_attention=auto "
                    "falls back: varlen_attn runs on CUDA only (device cpu))")
    # the reasons checked before any CUDA query: dtype, head_dim
    assert "takes bf16 or fp16 (the model computes in torch.float32)" in choose_packed_attention(
        "auto", device=cuda, dtype=torch.float32, head_dim=64)[1]
    assert "head_dim a multiple of 8 up to 256 (got 100)" in choose_packed_attention(
        "auto", device=cuda, dtype=torch.bfloat16, head_dim=100)[1]
    assert choose_packed_attention("flex", device=cuda, dtype=torch.bfloat16, head_dim=64)[0] \
        == "flex"
    with pytest.raises(ValueError, match=r"algo.packed_attention=varlen cannot run here: "
                                         r"varlen_attn runs on CUDA only \(device cpu\); set "
                                         r"algo.packed_attention=auto or flex"):
        choose_packed_attention("varlen", device=cpu, dtype=torch.bfloat16, head_dim=64)
    with pytest.raises(ValueError, match=r"algo.packed_attention='fa3' is not one of"):
        choose_packed_attention("fa3", device=cpu, dtype=torch.bfloat16, head_dim=64)
    # fa4 by name: refused where it cannot run, with the reason (none of these queries CUDA)
    for device, dtype, head_dim, why in (
            (cpu, torch.bfloat16, 64, r"FlashAttention-4 runs on CUDA only \(device cpu\)"),
            (cuda, torch.float32, 64,
             r"FlashAttention-4 takes bf16 or fp16 \(the model computes in torch.float32\)"),
            (cuda, torch.bfloat16, 100,
             r"FlashAttention-4 takes head_dim a multiple of 8 up to 256 \(got 100\)")):
        with pytest.raises(ValueError, match=r"algo.packed_attention=fa4 cannot run here: " + why
                           + r"; set algo.packed_attention=auto, varlen or flex"):
            choose_packed_attention("fa4", device=device, dtype=dtype, head_dim=head_dim)


def test_auto_prefers_fa4_where_it_runs_else_varlen_saying_why():
    from hybridflow.models.packed_choice import FlashMachine, choose

    def machine(cap=(9, 0), varlen=None, fa4=None):
        return FlashMachine("cuda", lambda: cap, lambda: varlen, lambda: fa4)

    bf16 = dict(dtype=torch.bfloat16, head_dim=64)
    assert choose("auto", machine(), **bf16) == (
        "fa4", "packed attention: FlashAttention-4 varlen (flash_attn.cute; "
               "algo.packed_attention=auto)")
    why = "flash-attn-4 is not installed (pip install flash-attn-4; No module named 'flash_attn')"
    assert choose("auto", machine(fa4=why), **bf16) == (
        "varlen", "packed attention: torch varlen_attn (FlashAttention-2 varlen; "
                  f"algo.packed_attention=auto; {why})")
    # an sm_80 card: varlen, saying why not fa4; flex where varlen's kernels are missing too
    assert choose("auto", machine(cap=(8, 0)), **bf16)[1].endswith(
        "FlashAttention-4 needs compute capability 9.0+ (got 8.0))")
    assert choose("auto", machine(cap=(8, 0), varlen="no kernels"), **bf16) == (
        "flex", "packed attention: flex_attention document mask (algo.packed_attention=auto "
                "falls back: no kernels)")
    # asked for by name: varlen, and no word of FlashAttention-4 (whose import is not even tried)
    def no_import():
        raise AssertionError("varlen by name asked flash-attn-4")
    named = FlashMachine("cuda", lambda: (9, 0), lambda: None, no_import)
    assert choose("varlen", named, **bf16)[1] \
        == "packed attention: torch varlen_attn (FlashAttention-2 varlen; algo.packed_attention=varlen)"
    with pytest.raises(ValueError, match=r"algo.packed_attention=fa4 cannot run on H100: nope; "):
        choose("fa4", machine(fa4="nope"), where="on H100", **bf16)


def test_a_broken_flash_attn_4_is_a_reason_not_a_crash(monkeypatch):
    import builtins
    real = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "flash_attn.cute":
            raise RuntimeError("libcute_dsl_runtime.so: cannot open shared object file")
        return real(name, *args, **kwargs)

    attention._fa4_import.cache_clear()
    monkeypatch.setattr(builtins, "__import__", broken)
    try:
        assert attention._fa4() is None
        assert attention._fa4_import()[1] == ("flash-attn-4 does not import: RuntimeError: "
                                              "libcute_dsl_runtime.so: cannot open shared object "
                                              "file")
    finally:
        attention._fa4_import.cache_clear()


def test_fa4_compile_cache_defaults_on_in_the_user_cache_folder(tmp_path):
    env = attention.fa4_compile_cache_env({"XDG_CACHE_HOME": str(tmp_path)})
    folder = tmp_path / "hybridflow" / "flash_attention_cute"
    assert env == {attention.FA4_CACHE_DIR_ENV: str(folder), attention.FA4_CACHE_ENV: "1"}
    assert folder.is_dir()  # made here: flash-attn-4 would fail its import where it cannot
    # the user's folder is kept; the user's switch, either way, leaves everything as it is
    own = tmp_path / "own"
    assert attention.fa4_compile_cache_env({attention.FA4_CACHE_DIR_ENV: str(own)}) == {
        attention.FA4_CACHE_ENV: "1"}
    for value in ("0", "1"):
        assert attention.fa4_compile_cache_env({attention.FA4_CACHE_ENV: value}) == {}


def test_fa4_compile_noise_is_the_dsl_warning():
    import re
    line = ("Argument aux_data (position 17) cannot be converted to a JitArgument for function "
            "'cutlass___call___flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90'. Its type")
    assert re.match(attention.FA4_COMPILE_NOISE, line)
    assert not re.match(attention.FA4_COMPILE_NOISE, "Argument q (position 0) is wrong")


def test_fa4_compile_cache_off_where_its_folder_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env = attention.fa4_compile_cache_env({attention.FA4_CACHE_DIR_ENV: str(blocker / "cache")})
    assert env == {attention.FA4_CACHE_ENV: "0"}


def test_fa4_kernel_gets_the_packed_row_as_views_and_its_documents(monkeypatch):
    """SDPAttention hands FlashAttention-4's varlen function the [S, heads, head_dim] views of one
    packed row, the documents' cu_seqlens and longest length, causal, the softmax scale; here a
    stand-in computes each document alone with SDPA, so the layer's output must equal flex's."""
    from megatron.core.transformer.enums import AttnMaskType


    calls = []

    def fake_fa4(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal):
        calls.append((q.shape, k.shape, cu_seqlens_q.tolist(), max_seqlen_q, causal))
        assert cu_seqlens_k is cu_seqlens_q and max_seqlen_k == max_seqlen_q
        out = torch.empty_like(q)
        bounds = cu_seqlens_q.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale,
                                               enable_gqa=True)
            out[a:b] = o.transpose(0, 1)
        return out, None

    monkeypatch.setattr(attention, "_fa4", lambda: fake_fa4)
    lengths = [5, 1, 7, 3]
    s, h, hkv, d = sum(lengths), 4, 2, 8
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, 1, h, d, generator=g)
    k, v = (torch.randn(s, 1, hkv, d, generator=g) for _ in range(2))
    layer = attention.SDPAttention.__new__(attention.SDPAttention)
    torch.nn.Module.__init__(layer)
    layer.attn_mask_type, layer.dropout_p, layer.softmax_scale = AttnMaskType.causal, 0.0, 0.3
    layer.training = False
    out = layer(q, k, v, attention.packed_documents(doc, cu, 7, kernel="fa4"))
    ref = layer(q, k, v, attention.packed_documents(doc, cu, 7, kernel="flex"))
    assert calls == [((s, h, d), (s, hkv, d), [0, 5, 6, 13, 16], 7, True)]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompts,responses,multiple", [
    (PROMPT_LENS, RESPONSE_LENS, 1),
    (PROMPT_LENS, RESPONSE_LENS, 4),
    ([105, 97, 130, 1], [300, 1, 1024, 0], 2),
    ([5, 0, 3], [2, 0, 1], 2),
])
def test_fit_packed_pads_to_one_shape_and_keeps_the_rows(prompts, responses, multiple):
    """A packed row at a PackedShape (the update's CUDA graphs): its real tokens, positions and
    gather indices unchanged, the tail in pieces no longer than max_seqlen, then empty documents
    to the fixed count; document_ids and cu_seqlens still describe the same spans."""
    pk = pack_rows(_ragged_batch(prompts, responses), multiple=multiple)
    real = sum(p + r for p, r in zip(prompts, responses))
    shape = shape_for([pk], length=pk.input_ids.shape[1] + 300)
    assert shape.max_seqlen % 128 == 0 and shape.max_seqlen >= max(p + r for p, r in zip(prompts, responses))
    f = fit_packed(pk, shape)
    assert f is not None and f.fitted and not pk.fitted
    assert f.input_ids.shape == (1, shape.length) and f.max_seqlen == shape.max_seqlen
    assert f.cu_seqlens.shape == (shape.documents + 1,) and f.cu_seqlens.dtype == torch.int32
    assert f.cu_seqlens[-1] == shape.length and (f.cu_seqlens.diff() >= 0).all()
    assert f.cu_seqlens.diff().max() <= shape.max_seqlen
    assert torch.equal(f.input_ids[:, :real], pk.input_ids[:, :real]) and (f.input_ids[:, real:] == 0).all()
    assert torch.equal(f.position_ids[:, :real], pk.position_ids[:, :real])
    assert torch.equal(f.targets[:, :real - 1], pk.targets[:, :real - 1])
    for name in ("gather", "valid", "scored"):
        assert torch.equal(getattr(f, name), getattr(pk, name)), name
    # the non-empty documents are the runs of document_ids, each counted from position 0
    docs = f.cu_seqlens.diff()
    ids, counts = torch.unique_consecutive(f.document_ids, return_counts=True)
    assert counts.tolist() == docs[docs > 0].tolist()
    for i, (a, b) in enumerate(zip(f.cu_seqlens[:-1].tolist(), f.cu_seqlens[1:].tolist())):
        assert torch.equal(f.position_ids[0, a:b], torch.arange(b - a)), i
    # what does not fit: a shorter length, too few documents, a row longer than max_seqlen
    longest = max(p + r for p, r in zip(prompts, responses))
    assert fit_packed(pk, PackedShape(real - 1, shape.documents, shape.max_seqlen)) is None
    assert fit_packed(pk, PackedShape(shape.length, len([1 for p, r in zip(prompts, responses) if p + r]), shape.max_seqlen)) is None
    if longest > 1:
        assert fit_packed(pk, PackedShape(shape.length, shape.documents, longest - 1)) is None


def test_shape_for_takes_the_most_documents_with_headroom_and_grows():
    a = pack_rows(_ragged_batch([3] * 6, [2] * 6), multiple=1)   # 6 rows of 5, a tail of 320
    b = pack_rows(_ragged_batch([100, 20], [150, 9]), multiple=1)  # a row of 250: max_seqlen 256
    shape = shape_for([a, b], length=100 + 250)
    # a: 6 rows + the tail in 2 pieces of <= 256 = 8 documents, x 1.25 = 10, rounded up to 16
    assert shape == PackedShape(length=350, documents=16, max_seqlen=256)
    assert fit_packed(a, shape) is not None and fit_packed(b, shape) is not None
    grown = shape_for([a], length=350, at_least=PackedShape(350, 16, 512))
    assert grown == PackedShape(length=350, documents=16, max_seqlen=512)


@pytest.mark.parametrize("multiple", [1, 4])
def test_fit_planned_from_row_lengths_agrees_with_packing(multiple):
    """The graphed update plans which micro-batches fit the packed shape from their rows' lengths,
    before packing any (Engine._fit_to_shape): the lengths, the packed length, the fit and the
    shape are those the packed rows give."""
    from hybridflow.data.packing import (_row_lengths, fits, packed_length, row_lengths,
                                         shape_for_rows)

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(12):
        b = int(torch.randint(1, 7, (1,), generator=g))
        prompts = torch.randint(0, 40, (b,), generator=g).tolist()
        responses = torch.randint(0, 90, (b,), generator=g).tolist()
        p, r = max(prompts + [1]), max(responses + [1])
        prompt_mask = (torch.arange(p)[None] >= p - torch.tensor(prompts)[:, None]).long()
        response_mask = (torch.arange(r)[None] < torch.tensor(responses)[:, None]).long()
        batches.append(RolloutBatch(
            prompt_ids=torch.randint(1, 50, (b, p), generator=g) * prompt_mask,
            prompt_mask=prompt_mask, response_ids=torch.randint(1, 50, (b, r), generator=g)
            * response_mask, response_mask=response_mask, group_ids=torch.arange(b),
            indices=torch.arange(b)))
    packed = [pack_rows(mb, multiple=multiple) for mb in batches]
    rows = [row_lengths(mb) for mb in batches]
    for mb, p, r in zip(batches, packed, rows):
        assert torch.equal(r, _row_lengths(p))
        assert packed_length(r, multiple) == p.input_ids.shape[1]
    seen = set()
    for length, max_seqlen, documents in ((256, 128, 8), (400, 256, 16), (160, 64, 6)):
        shape = PackedShape(length=length, documents=documents, max_seqlen=max_seqlen)
        planned = [fits(r, shape) for r in rows]
        assert planned == [fit_packed(p, shape) is not None for p in packed]
        seen.update(planned)
    assert seen == {True, False}  # both outcomes checked
    assert shape_for_rows(rows, length=512) == shape_for(packed, length=512)
