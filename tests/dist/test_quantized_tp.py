"""rollout.quantization=int4 at TP_g = 2 (2 gloo ranks): each rank quantizes its own shards, and
because int4's groups (128 input columns) never straddle a shard boundary and its scales are per
output row, the shards' codes are exactly the full matrices' codes: the TP_g = 2 generator computes
what the TP_g = 1 int4 generator computes (same greedy tokens, log-probs to fp32 rounding), with the
row-parallel GEMMs' all-reduces between. (fp8's per-channel scales of the row-parallel shards are
per shard, so fp8 differs slightly across TP sizes: not compared.)"""

import dataclasses

import torch

from hybridflow.config import ModelConfig, RolloutConfig
from tests.dist.launcher import run_ranks

# every shard's input width a multiple of 128: proj 4 x 64 / 2, fc2 256 / 2
CFG = ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=256, num_attention_heads=4,
                  num_query_groups=2, vocab_size=37, add_qkv_bias=True)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [30, 2, 2, 7, 1]]


def _ranks_fn():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hybridflow.parallel import groups, param_rules
    from hybridflow.rollout import Generator
    from tests.unit.test_rollout import random_params

    full = {k: v / 3 if v.dim() == 2 and "embedding" not in k else v
            for k, v in random_params(CFG).items()}  # V_PAD = 40 rows: 20 per rank
    cfg = RolloutConfig(max_new_tokens=8, temperature=0.0, return_logprobs=True)
    make = lambda p, g: Generator(model_cfg=CFG, params=p, tp_group=g,  # noqa: E731
                                  device=torch.device("cpu"), dtype=torch.float32,
                                  true_vocab_size=CFG.vocab_size, quantization="int4")
    ref = make(full, None).generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0)
    groups.init_model_parallel(tp=2, pp=1, seed=0)
    group = ps.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    shards = {n: param_rules.shard_tensor(n, t, tp_rank=rank, tp_size=2).contiguous()
              for n, t in full.items()}
    out = make(shards, group).generate(PROMPTS, cfg=cfg, eos_id=-1, pad_id=0, seed=0)
    sampled = dataclasses.replace(cfg, temperature=1.0, n=2)
    s1 = make(full, None).generate(PROMPTS, cfg=sampled, eos_id=-1, pad_id=0, seed=4)
    s2 = make(shards, group).generate(PROMPTS, cfg=sampled, eos_id=-1, pad_id=0, seed=4)
    return {"tp1": ref, "tp2": out, "s1": s1, "s2": s2}


def test_int4_tp2_generates_the_tp1_int4_tokens():
    for r in run_ranks(_ranks_fn, 2):
        assert torch.equal(r["tp1"].response_ids, r["tp2"].response_ids)
        assert (r["tp1"].rollout_logprobs - r["tp2"].rollout_logprobs).abs().max() < 1e-4
        assert torch.equal(r["s1"].response_ids, r["s2"].response_ids)
