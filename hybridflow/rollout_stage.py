"""The trainer's rollout and reward stages: reshard -> generate -> RolloutBatch, and scoring.

Generation runs on the gen layout (TP_g x 1 x DP_g) with weights the Resharder gathers from the
training shards (no second model); when TP_g == TP_t and PP_t == 1 the training parameters are used
as they are. The gen layout has more replicas than training: inside one training model-parallel group
(the TP_t x PP_t ranks of a DP replica) there are k = PP_t * TP_t / TP_g gen replicas. The DP replica's
prompts are split into k chunks, gen replica j generates chunk j, and the chunks are all-gathered over
the model-parallel group, so every rank of the DP replica ends with the same full batch (chunk sizes
differ by at most one; with fewer prompts than gen replicas, every gen replica generates all of them
with the same seed instead). Sequence scores come from the rule reward (decoded text) and/or
the reward model (scalar head at the last response token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from hybridflow.config import Config
from hybridflow.data.batch import RolloutBatch
from hybridflow.parallel.dp import dp_sum
from hybridflow.reward import compute_rule_rewards, get_reward_fn


def _left_pad(rows: list[list[int]], pad_id: int, width: int):
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


class RolloutStage:
    def __init__(self, cfg: Config, actor, tokenizer, reward_engine=None):
        self.cfg, self.actor, self.tok = cfg, actor, tokenizer
        self.reward_fn = get_reward_fn(cfg.reward.fn) if cfg.reward.fn is not None else None
        self.reward_engine = reward_engine
        self.resharder = self._build_resharder()

    def _build_resharder(self):
        tp_t, pp_t = self.cfg.parallel.tensor_parallel_size, self.cfg.parallel.pipeline_parallel_size
        tp_g = self.cfg.rollout.tensor_parallel_size or tp_t
        m = tp_t // tp_g
        # gen replica of this rank inside its training model-parallel group, and their number
        self.replica = ps.get_pipeline_model_parallel_rank() * m + ps.get_tensor_model_parallel_rank() % m
        self.num_replicas = pp_t * m
        if tp_g == tp_t and pp_t == 1:
            self.gen_tp_group = ps.get_tensor_model_parallel_group()
            return None
        from hybridflow.parallel.groups import new_reshard_groups
        from hybridflow.parallel.layout import Layout
        from hybridflow.parallel.reshard import Resharder

        layout = Layout(world_size=torch.distributed.get_world_size(), tp_t=tp_t, pp_t=pp_t,
                        tp_g=tp_g)
        groups = new_reshard_groups(layout)
        self.gen_tp_group = groups.gen_tp
        return Resharder(self.actor.module, layout=layout, groups=groups)

    def _gen_params(self):
        if self.resharder is None:
            return dict(self.actor.module.named_parameters())
        return self.resharder.gather()

    def generate(self, items, *, step: int, timer, round_index: int = 0) -> RolloutBatch:
        from hybridflow.rollout import Generator

        r = self.cfg.rollout
        # chunk j of the DP replica's prompts for gen replica j (sizes differ by at most one)
        k, split = self.num_replicas, self.num_replicas > 1 and len(items) >= self.num_replicas
        seed = self.cfg.trainer.seed * 1_000_003 + step * 1009 + ps.get_data_parallel_rank()
        seed += round_index * 1_000_000_007  # dynamic sampling's later rounds of one step
        mine = items
        if split:
            base, extra = divmod(len(items), k)
            start = self.replica * base + min(self.replica, extra)
            mine = items[start:start + base + (self.replica < extra)]
            seed += 7919 * self.replica
        with timer("reshard"):
            params = self._gen_params()
        try:
            with timer("gen"):
                gen = Generator(model_cfg=self.actor.model_cfg, params=params,
                                tp_group=self.gen_tp_group, device=self.actor.device,
                                dtype=self.actor.tcfg.params_dtype,
                                true_vocab_size=self.actor.vocab_limit)
                with torch.no_grad():
                    out = gen.generate([it.prompt_ids for it in mine], cfg=r,
                                       eos_id=-1 if r.ignore_eos else self.tok.eos_id,
                                       pad_id=self.tok.pad_id, seed=seed)
                gen.release()
                del gen
                parts = (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
                if r.return_logprobs:
                    parts += (out.logprobs,)
                parts = tuple(t.cpu() for t in parts)
                if split:
                    parts = self._gather_replicas(parts)
        finally:
            if self.resharder is not None:
                self.resharder.release()
        n = r.n
        local = len(items)
        first = ps.get_data_parallel_rank() * local
        group_ids = (first + torch.arange(local)).repeat_interleave(n)
        indices = torch.tensor([it.index for it in items]).repeat_interleave(n)
        p_ids, p_mask, r_ids, r_mask = parts[:4]
        batch = RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask.long(), response_ids=r_ids,
                             response_mask=r_mask.long(), group_ids=group_ids, indices=indices,
                             rollout_logprobs=parts[4].float() if r.return_logprobs else None)
        return batch

    def _gather_replicas(self, parts):
        """Concatenate the gen replicas' chunks (in replica order) on every model-parallel rank."""
        group = ps.get_model_parallel_group()
        objs = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(objs, parts, group=group)
        tp_t = ps.get_tensor_model_parallel_world_size()
        m = self.num_replicas // ps.get_pipeline_model_parallel_world_size()
        # group rank g = pp * TP_t + tp (ranks ascend); replica pp * m + tp is led by tp < m
        chunks = [objs[pp * tp_t + tp] for pp in range(self.num_replicas // m) for tp in range(m)]
        p = max(c[0].shape[1] for c in chunks)
        r = max(c[2].shape[1] for c in chunks)
        out = []
        for k, width in enumerate((p, p, r, r, r)[:len(chunks[0])]):  # prompts left, responses right
            fill = self.tok.pad_id if k in (0, 2) else 0  # ids get the pad id, masks/log-probs 0
            out.append(torch.cat([F.pad(c[k], (width - c[k].shape[1], 0) if k < 2 else
                                        (0, width - c[k].shape[1]), value=fill) for c in chunks]))
        return tuple(out)

    def score(self, items, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        scores, metrics = torch.zeros(batch.batch_size), {}
        if self.reward_fn is not None:
            scores, metrics = self._rule_scores(items, batch)
        if self.reward_engine is not None:
            a = self.cfg.algo
            rm = self.reward_engine.compute_scores(
                batch, micro_batch_size=a.forward_micro_batch_size_per_gpu or a.micro_batch_size_per_gpu)
            metrics["reward/model_score/mean"] = float(rm.mean())
            scores = scores + self.cfg.reward.model_weight * rm
        dp = ps.get_data_parallel_world_size()  # every DP rank holds the same number of rows
        return scores, {k: dp_sum(v) / dp for k, v in sorted(metrics.items())}

    def _rule_scores(self, items, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        n = self.cfg.rollout.n
        rows = [items[i // n] for i in range(batch.batch_size)]
        lengths = batch.response_mask.sum(1).tolist()
        texts = [self.tok.decode(batch.response_ids[i, :lengths[i]].tolist())
                 for i in range(batch.batch_size)]
        scores, extra = compute_rule_rewards(
            self.reward_fn, prompts=[it.prompt_text for it in rows], responses=texts,
            ground_truths=[it.ground_truth for it in rows],
            extra_infos=[it.extra_info for it in rows], indices=[it.index for it in rows],
            data_sources=[it.data_source for it in rows])
        metrics = {f"reward/{k}/mean": sum(v) / len(v) for k, v in extra.items()}
        return torch.tensor(scores, dtype=torch.float32), metrics

    def sft_batch(self, items) -> RolloutBatch:
        """Prompt + reference response (`extra_info.sft_response`) + EOS, as a RolloutBatch."""
        responses = []
        for it in items:
            ref = (it.extra_info or {}).get("sft_response")
            if ref is None:
                raise ValueError(f"trainer.sft_warmup_steps > 0 needs extra_info.sft_response in "
                                 f"every record; record {it.index} has none")
            responses.append(self.tok.encode(ref) + [self.tok.eos_id])
        p_ids, p_mask = _left_pad([it.prompt_ids for it in items], self.tok.pad_id,
                                  max(len(it.prompt_ids) for it in items))
        width = max(len(r) for r in responses)
        r_ids = torch.full((len(items), width), self.tok.pad_id, dtype=torch.long)
        r_mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, r in enumerate(responses):
            r_ids[i, :len(r)] = torch.tensor(r)
            r_mask[i, :len(r)] = 1
        idx = torch.tensor([it.index for it in items])
        return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids,
                            response_mask=r_mask, group_ids=idx, indices=idx)
