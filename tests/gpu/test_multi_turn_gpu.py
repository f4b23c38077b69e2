"""Multi-turn rollouts on a GPU in bf16: the rows resumed after tool calls (results appended to the
KV cache by a short prefill, rows at different turns in one batch) give the log-probs of a
from-scratch prefill of the whole conversation, within bf16 tolerance."""

import pytest
import torch

from hybridflow.rollout import Generator, decoder
from tests.unit.test_multi_turn import (CFG, V, byte_tokenizer, call, params, run, tool_config)

pytestmark = pytest.mark.gpu


def test_resumed_rows_match_a_full_prefill_bf16(tmp_path):
    tok = byte_tokenizer(tmp_path)
    gen = Generator(model_cfg=CFG, params={k: v.cuda() for k, v in params(CFG).items()},
                    tp_group=None, device="cuda", dtype=torch.bfloat16, true_vocab_size=V)
    end = tok.encode("<|im_end|>")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is 6*7?", "Two steps: 2+3 then 5*5", "no tools here")]
    forced = [tok.encode(call("6*7")) + tok.encode("It is 42") + end,
              tok.encode(call("2+3")) + tok.encode(call("5*5")) + tok.encode("25") + end,
              tok.encode("nothing") + end]
    (batch, m), _ = run(gen, tok, "hermes", tool_config(tmp_path, "calculator"), prompts, forced)
    assert m["tool_calls/mean"] == 1.0
    cos, sin = decoder.rope_tables(gen.w.inv_freq, 512, dtype=torch.bfloat16, device="cuda")
    for b in range(3):
        n = int(batch.response_mask[b].sum())
        resp = batch.response_ids[b, :n].tolist()
        seq = torch.tensor([prompts[b] + resp], device="cuda")
        lg = decoder.forward(gen.w, seq, torch.arange(seq.shape[1], device="cuda")[None],
                             torch.ones_like(seq).bool(), cos_tab=cos, sin_tab=sin)[0]
        ref = torch.log_softmax(lg[len(prompts[b]) - 1:-1], -1).gather(
            1, torch.tensor(resp, device="cuda")[:, None])[:, 0]
        model = ~batch.tool_mask[b, :n].bool().cuda()
        got = batch.rollout_logprobs[b, :n].cuda()
        # bf16 weights and activations: the cached and the re-prefilled paths round differently
        # (other GEMM shapes and attention kernels), by a few bf16 ulps of the logits
        torch.testing.assert_close(got[model], ref[model].float(), rtol=0.02, atol=0.1)
        assert (got[model] - ref[model].float()).abs().mean() < 0.02
