"""Batches of rows of given prompt and response lengths (prompts left-padded, responses
right-padded), with old / reference log-probs and advantages for an actor update."""

import torch

from hybridflow.data.batch import RolloutBatch


def ragged_batch(prompts: list, responses: list, *, seed: int = 0, vocab: int = 50,
                 logprob: float = -3.9) -> RolloutBatch:
    """Row i: prompts[i] prompt tokens and responses[i] response tokens (ids in 1..vocab - 1), two
    rows per group, log-probs near `logprob`, advantages on the response tokens."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(prompts), max(prompts), max(responses)
    prompt_mask = (torch.arange(p)[None] >= p - torch.tensor(prompts)[:, None]).long()
    response_mask = (torch.arange(r)[None] < torch.tensor(responses)[:, None]).long()
    return RolloutBatch(
        prompt_ids=torch.randint(1, vocab, (b, p), generator=g) * prompt_mask, prompt_mask=prompt_mask,
        response_ids=torch.randint(1, vocab, (b, r), generator=g) * response_mask,
        response_mask=response_mask, group_ids=torch.arange(b) // 2, indices=torch.arange(b),
        old_logprobs=logprob + 0.1 * torch.randn(b, r, generator=g),
        ref_logprobs=logprob + 0.1 * torch.randn(b, r, generator=g),
        advantages=torch.randn(b, 1, generator=g) * response_mask)
