"""HF checkpoints loaded at TP=2 and at PP=2 (2 gloo ranks) give transformers' logits; each rank
reads only its shard; gathering the shards and exporting gives back the original tensors."""

import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.dist.launcher import run_ranks  # noqa: E402
from tests.hf_models import KINDS, hf_logits, make_checkpoint  # noqa: E402

IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))  # (B, S)


def _forward_pp(model, ids):
    """Logits (B, S, V_pad) on the last stage through Megatron's forward-only pipeline schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(ids.shape[1]).expand_as(ids)

    def step(data_iterator, m):
        out = m(*next(data_iterator), attention_mask=None)
        return out, lambda o: (o.sum() * 0.0, {"logits": o.detach()})

    store = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([(ids, pos)]), model=[model],
        num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
        forward_only=True)
    return store[0]["logits"] if store else None


def _ranks_fn(paths, ids):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.models.build import build_model
    from hybridflow.models.hf import load_hf_weights, read_hf_config, save_hf_checkpoint
    from hybridflow.parallel import groups
    from tests.dist.parity_util import gather_full

    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        ctx = groups.init_model_parallel(tp=tp, pp=pp, seed=0)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        for kind, path in paths.items():
            cfg = read_hf_config(path)
            model = build_model(cfg, role="actor", ctx=ctx).eval()
            read = load_hf_weights(model, path, cfg, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank,
                                   pp_size=pp)
            with torch.no_grad():
                if pp == 1:  # vocab-parallel logits: gather the TP shards
                    local = model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
                    parts = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                    logits = torch.cat(parts, -1)
                else:
                    logits = _forward_pp(model, ids)
            full = gather_full(dict(model.named_parameters()), num_layers=cfg.num_layers)
            export = os.path.join(os.path.dirname(path), f"export_{kind}_tp{tp}pp{pp}")
            if dist.get_rank() == 0:
                save_hf_checkpoint(export, full, cfg, max_shard_bytes=50_000)
            dist.barrier()
            out[(kind, tp, pp, dist.get_rank())] = {
                "logits": None if logits is None else logits[..., : cfg.vocab_size],
                "read": read, "export": export}
    return out


def test_tp2_and_pp2_match_transformers_and_round_trip(tmp_path):
    from safetensors.torch import load_file

    paths = {k: make_checkpoint(k, str(tmp_path / k), max_shard_size="40KB" if k == "llama"
                                else None) for k in KINDS}
    ref = {k: hf_logits(p, IDS) for k, p in paths.items()}
    results = run_ranks(_ranks_fn, 2, paths, IDS)
    merged = {k: v for r in results for k, v in r.items()}

    def tensors(d):
        return {k: v for f in os.listdir(d) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}

    for kind in KINDS:
        original = tensors(paths[kind])
        for rank in (0, 1):  # TP=2: both ranks hold the full logits after the gather
            got = merged[(kind, 2, 1, rank)]["logits"]
            torch.testing.assert_close(got, ref[kind], atol=1e-4, rtol=1e-4)
        assert merged[(kind, 1, 2, 0)]["logits"] is None  # PP=2: logits on the last stage only
        torch.testing.assert_close(merged[(kind, 1, 2, 1)]["logits"], ref[kind], atol=1e-4,
                                   rtol=1e-4)
        # TP=2: the two ranks read disjoint halves of every split tensor (the vocab split is of the
        # padded vocab, so rank 1 reads one row less for llama's 127), norms whole
        r0, r1 = (merged[(kind, 2, 1, r)]["read"] for r in (0, 1))
        assert r0.keys() == r1.keys() == original.keys()
        for name, t in original.items():
            if "norm" in name:
                assert r0[name] == r1[name] == t.numel(), name
            else:
                vocab = name.endswith(("embed_tokens.weight", "lm_head.weight"))
                want = -(-t.shape[0] // 2) * t.shape[1] if vocab else t.numel() // 2
                assert r0[name] == want and r0[name] + r1[name] == t.numel(), name
        # PP=2: stage 0 reads layer 0 and the embedding only; stage 1 layer 1, the norm, the head
        stage0, stage1 = (set(merged[(kind, 1, 2, r)]["read"]) for r in (0, 1))
        assert all(".layers.0." in n or "embed" in n for n in stage0)
        assert all(".layers.1." in n or n in ("model.norm.weight", "lm_head.weight",
                                                "model.embed_tokens.weight") for n in stage1)
        assert stage0 | stage1 == set(original)
        for tp, pp in ((2, 1), (1, 2)):  # export from the gathered shards is bit-identical
            exported = tensors(merged[(kind, tp, pp, 0)]["export"])
            assert exported.keys() == original.keys()
            assert all(torch.equal(exported[k], original[k]) for k in original), (kind, tp, pp)
