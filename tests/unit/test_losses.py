"""Policy/value/entropy/KL losses and aggregation against numbers worked out by hand."""

import math

import pytest
import torch

from hybridflow.algo import (
    AGG_MODES,
    agg_loss,
    entropy_loss,
    get_policy_loss,
    kl_loss,
    masked_mean,
    masked_whiten,
    register_policy_loss,
    value_loss,
)

JUNK = 100.0

# ---------------------------------------------------------------- agg_loss
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, JUNK, JUNK]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),
    ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2 + 3) + 4) / (2 * 5)),  # C = 5, not the width 3
])
def test_agg_modes_by_hand(mode, expected):
    torch.testing.assert_close(agg_loss(LOSS, MASK, mode, loss_scale_factor=5),
                               torch.tensor(expected))


def test_agg_sum_norm_needs_a_constant():
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=0)


def test_agg_unknown_mode():
    with pytest.raises(ValueError, match=r"'token-sum'.*seq-mean-token-mean"):
        agg_loss(LOSS, MASK, "token-sum")


def test_agg_skips_empty_rows_and_given_denominators():
    loss = torch.cat([LOSS, torch.full((1, 3), JUNK)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])  # third row: no valid token
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), torch.tensor(5.0))
    torch.testing.assert_close(agg_loss(loss, mask, "token-mean", num_tokens=8), torch.tensor(10 / 8))
    torch.testing.assert_close(agg_loss(loss, mask, "seq-mean-token-mean", num_seqs=4), torch.tensor(6 / 4))
    with pytest.raises(ValueError, match="num_seqs"):
        agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=0)


def reference_agg(loss, lengths, mode, scale=7.0):
    """Plain-Python aggregation of rows `loss` (lists) over their first `lengths` entries."""
    rows = [r[:n] for r, n in zip(loss, lengths)]
    seqs = [r for r in rows if r]
    if mode == "token-mean":
        return sum(map(sum, seqs)) / sum(map(len, seqs))
    if mode == "seq-mean-token-sum":
        return sum(map(sum, seqs)) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in seqs) / len(seqs)
    return sum(map(sum, seqs)) / (len(seqs) * scale)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_full_batch(mode):
    """Uneven masks over three micro-batches: with the global normalisers the micro-batch losses
    (and their gradients) sum to the full batch's, which matches a plain-Python reference."""
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(7, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    lengths = [6, 1, 4, 0, 3, 2, 5]  # ragged, one empty row
    mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).long()
    norm = dict(num_tokens=int(mask.sum()), num_seqs=sum(n > 0 for n in lengths),
                loss_scale_factor=7.0)
    full = agg_loss(loss, mask, mode, loss_scale_factor=7.0)
    assert abs(full.item() - reference_agg(loss.tolist(), lengths, mode)) < 1e-12
    (g_full,) = torch.autograd.grad(full, loss)
    parts = [agg_loss(loss[s], mask[s], mode, **norm) for s in (slice(0, 2), slice(2, 5), slice(5, 7))]
    torch.testing.assert_close(sum(parts), full)
    (g_parts,) = torch.autograd.grad(sum(parts), loss)
    torch.testing.assert_close(g_parts, g_full)
    # Without the global normalisers the micro-batches do not add up.
    local = sum(agg_loss(loss[s], mask[s], mode, loss_scale_factor=7.0)
                for s in (slice(0, 2), slice(2, 5), slice(5, 7)))
    assert not torch.allclose(local, full)


# ---------------------------------------------------------------- vanilla policy loss
# old_logprobs = 0, logprobs = log(r). clip low 0.2, high 0.28, dual clip c = 3.
#   token  A    r    -A r   -A clip(r,.8,1.28)  max    dual (A<0)         clipped? dual?
#   a     +1   1.1   -1.1   -1.1                -1.1   -                  no       no
#   b     +1   1.5   -1.5   -1.28               -1.28  -                  yes      no
#   c     -1   0.5    0.5    0.8                 0.8   min(0.8,3)=0.8     yes      no
#   d     -1   5.0    5.0    1.28                5.0   min(5,3)=3         no       yes
#   e     +2   0.5   -1.0   -1.6                -1.0   -                  no       no
#   f     -2   1.2    2.4    2.4                 2.4   min(2.4,6)=2.4     no       no
# Row 0 = a b c d; row 1 = e f + two masked junk tokens.
RATIOS = [[1.1, 1.5, 0.5, 5.0], [0.5, 1.2, math.exp(50.0), 1.0]]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0], [2.0, -2.0, JUNK, -JUNK]])
PMASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
TOKEN_LOSS = [-1.1, -1.28, 0.8, 3.0, -1.0, 2.4]


def run_vanilla(**kw):
    logprobs = torch.log(torch.tensor(RATIOS, dtype=torch.float64)).float().requires_grad_()
    args = dict(logprobs=logprobs, old_logprobs=torch.zeros(2, 4), advantages=ADV,
                response_mask=PMASK, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    args.update(kw)
    loss, metrics = get_policy_loss("vanilla")(**args)
    return loss, metrics, logprobs


def test_vanilla_token_mean_by_hand():
    loss, m, logprobs = run_vanilla()
    torch.testing.assert_close(loss, torch.tensor(sum(TOKEN_LOSS) / 6))  # 2.82 / 6
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(2 / 6))  # b, c
    torch.testing.assert_close(m["pg_clipfrac_lower"], torch.tensor(1 / 6))  # d
    kl = -sum(math.log(r) for r in [1.1, 1.5, 0.5, 5.0, 0.5, 1.2]) / 6
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(kl))
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    # d/dlogp of -A r is -A r on unclipped tokens (a, e, f); clipped and dual-clipped tokens
    # (b, c, d) and masked tokens get no gradient.
    loss.backward()
    expected = torch.tensor([[-1.1, 0.0, 0.0, 0.0], [-1.0, 2.4, 0.0, 0.0]]) / 6
    torch.testing.assert_close(logprobs.grad, expected)


def test_vanilla_seq_mean_token_mean():
    loss, _, _ = run_vanilla(agg_mode="seq-mean-token-mean")
    row0 = (-1.1 - 1.28 + 0.8 + 3.0) / 4
    row1 = (-1.0 + 2.4) / 2
    torch.testing.assert_close(loss, torch.tensor((row0 + row1) / 2))


def test_vanilla_dual_clip_disabled():
    loss, m, _ = run_vanilla(clip_ratio_c=None)  # token d keeps 5.0
    torch.testing.assert_close(loss, torch.tensor((sum(TOKEN_LOSS) - 3.0 + 5.0) / 6))
    assert m["pg_clipfrac_lower"] == 0


def test_vanilla_symmetric_clip():
    # clip_high 0.2: b clips at -1.2 instead of -1.28 (d is beyond both bounds; f's r=1.2 sits on it).
    loss, _, _ = run_vanilla(clip_ratio_high=0.2)
    torch.testing.assert_close(loss, torch.tensor((sum(TOKEN_LOSS) + 1.28 - 1.2) / 6))


def test_vanilla_bad_dual_clip_and_registry():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run_vanilla(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"'ppo2'.*vanilla"):
        get_policy_loss("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda **kw: None)


def test_vanilla_extreme_log_ratio_is_finite():
    logprobs = torch.tensor([[80.0, -80.0]])
    loss, m = get_policy_loss("vanilla")(
        logprobs=logprobs, old_logprobs=torch.zeros(1, 2), advantages=torch.tensor([[-1.0, 1.0]]),
        response_mask=torch.ones(1, 2), clip_ratio_c=None)
    # r clamps to exp(20) -> loss exp(20) on token 0; token 1: max(-exp(-20), -0.8) = -exp(-20).
    torch.testing.assert_close(loss, torch.tensor((math.exp(20.0) - math.exp(-20.0)) / 2))
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(0.0))


# ---------------------------------------------------------------- value loss
# cliprange 0.2:
#   v    old  R    (v-R)^2  clip(v,old±.2)  (vc-R)^2  max   clipped?
#   1.0  0.9  1.5  0.25     1.0              0.25     0.25  no
#   1.5  1.0  2.0  0.25     1.2              0.64     0.64  yes
#   0.0  1.0  0.0  0.0      0.8              0.64     0.64  yes
#   2.0  1.0  1.0  1.0      1.2              0.04     1.0   no
def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 1.5], [0.0, 2.0], [JUNK, 0.0]])
    old = torch.tensor([[0.9, 1.0], [1.0, 1.0], [0.0, 0.0]])
    returns = torch.tensor([[1.5, 2.0], [0.0, 1.0], [0.0, JUNK]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    loss, m = value_loss(values=values, old_values=old, returns=returns, response_mask=mask,
                         cliprange_value=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.25 + 0.64 + 0.64 + 1.0) / 4))
    torch.testing.assert_close(m["vf_clipfrac"], torch.tensor(0.5))
    loss, m = value_loss(values=values, old_values=old, returns=returns, response_mask=mask,
                         cliprange_value=None, agg_mode="seq-mean-token-sum")
    torch.testing.assert_close(loss, torch.tensor(0.5 * ((0.25 + 0.25) + (0.0 + 1.0)) / 2))
    assert m["vf_clipfrac"] == 0


# ---------------------------------------------------------------- entropy and KL losses
def test_entropy_loss():
    ent = torch.tensor([[1.0, 3.0], [2.0, JUNK]])
    mask = torch.tensor([[1, 1], [1, 0]])
    torch.testing.assert_close(entropy_loss(ent, mask, "token-mean"), torch.tensor(2.0))
    torch.testing.assert_close(entropy_loss(ent, mask, "seq-mean-token-sum"), torch.tensor(3.0))


def test_kl_loss_kinds():
    logp = torch.tensor([[0.0, -1.0], [-2.0, JUNK]])
    ref = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # d = logp - ref = [1, 0, -2] on valid tokens.
    torch.testing.assert_close(kl_loss(logp, ref, mask, "k1"), torch.tensor((1 + 0 - 2) / 3))
    torch.testing.assert_close(kl_loss(logp, ref, mask, "k2"), torch.tensor((0.5 + 0 + 2) / 3))
    k3 = (math.exp(-1) + 1 - 1) + 0.0 + (math.exp(2) - 2 - 1)
    torch.testing.assert_close(kl_loss(logp, ref, mask, "k3"), torch.tensor(k3 / 3))
    torch.testing.assert_close(kl_loss(logp, ref, mask, "k1", "seq-mean-token-mean"),
                               torch.tensor((0.5 - 2.0) / 2))


# ---------------------------------------------------------------- masked helpers
def test_masked_helpers():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(2.0))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 3.0]))
    # mean 2, unbiased var (1 + 0 + 1) / 2 = 1
    w = masked_whiten(x, mask)
    s = 1 / math.sqrt(1 + 1e-8)
    torch.testing.assert_close(w, torch.tensor([[-s, 0.0, 0.0], [s, 0.0, 0.0]]))
    w = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(w, torch.tensor([[2 - s, 2.0, 0.0], [2 + s, 0.0, 0.0]]))


# ---------------------------------------------------------------- TIS weights in the policy loss
def test_vanilla_rollout_is_weights_by_hand():
    # Per-token weights multiply the table's token losses; masked junk weights never count.
    w = torch.tensor([[0.5, 2.0, 1.0, 0.25], [1.5, 1.0, JUNK, JUNK]])
    loss, m, logprobs = run_vanilla(rollout_is_weights=w)
    ws = [0.5, 2.0, 1.0, 0.25, 1.5, 1.0]
    torch.testing.assert_close(loss, torch.tensor(sum(a * b for a, b in zip(ws, TOKEN_LOSS)) / 6))
    loss.backward()  # the weights scale the gradient of the unclipped tokens a, e, f; no grad to w
    expected = torch.tensor([[-1.1 * 0.5, 0.0, 0.0, 0.0], [-1.0 * 1.5, 2.4, 0.0, 0.0]]) / 6
    torch.testing.assert_close(logprobs.grad, expected)
    _, m_plain, _ = run_vanilla()
    assert all(torch.equal(m[k], m_plain[k]) for k in m)  # metrics describe the ratio, not w


# ---------------------------------------------------------------- the actor objective
def test_actor_objective_combines_the_registered_losses_by_hand():
    """pg - entropy_coeff * entropy + kl_coef * kl, each aggregated with the global normalisers."""
    from hybridflow.algo.objectives import actor_objective
    from hybridflow.config import AlgoConfig
    from hybridflow.data.batch import RolloutBatch

    cfg = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.1,
                     use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.5)
    logprobs = torch.log(torch.tensor(RATIOS, dtype=torch.float64)).float()
    ref = logprobs - torch.tensor([[1.0, 0.0, -1.0, 2.0], [0.5, 0.5, JUNK, JUNK]])  # k1 = these
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, JUNK, JUNK]])
    mb = RolloutBatch(prompt_ids=torch.zeros(2, 1, dtype=torch.long),
                      prompt_mask=torch.ones(2, 1, dtype=torch.long),
                      response_ids=torch.zeros(2, 4, dtype=torch.long), response_mask=PMASK,
                      group_ids=torch.arange(2), indices=torch.arange(2),
                      old_logprobs=torch.zeros(2, 4), ref_logprobs=ref, advantages=ADV)
    # this micro-batch is part of a mini-batch of 12 tokens
    loss, m = actor_objective(cfg, num_tokens=12, num_seqs=4)({"logprobs": logprobs,
                                                               "entropy": entropy}, mb)
    pg, ent, kl = sum(TOKEN_LOSS) / 12, 21.0 / 12, (1 + 0 - 1 + 2 + 0.5 + 0.5) / 12
    torch.testing.assert_close(loss, torch.tensor(pg - 0.1 * ent + 0.5 * kl))
    torch.testing.assert_close(m["actor/pg_loss"], torch.tensor(pg))
    torch.testing.assert_close(m["actor/kl_loss"], torch.tensor(kl))
    torch.testing.assert_close(m["actor/entropy"], torch.tensor(ent))
    torch.testing.assert_close(m["actor/pg_clipfrac"], torch.tensor(2 / 6 * 6 / 12))


# ---------------------------------------------------------------- Dr.GRPO end to end
def test_dr_grpo_estimator_and_sum_norm_by_hand():
    """Dr.GRPO = advantages s_i - mean_g(s) (no std) + seq-mean-token-sum-norm (no 1/|o_i|).
    On-policy (r = 1) the gradient on every valid token of row i is -A_i / (N_seqs * C)."""
    from hybridflow.algo import get_advantage_estimator

    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    token_rewards = torch.zeros(4, 4)
    token_rewards[torch.arange(4), mask.sum(1) - 1] = scores
    groups = torch.tensor([0, 0, 1, 1])
    adv, _ = get_advantage_estimator("grpo")(token_rewards=token_rewards, response_mask=mask,
                                            group_ids=groups, norm_by_std=False)
    a = [0.5, -0.5, -0.5, 0.5]  # group means 0.5 and 0.5; no division by the std (0.707)
    torch.testing.assert_close(adv, torch.tensor(a)[:, None] * mask)
    logprobs = torch.full((4, 4), -1.0, requires_grad=True)
    loss, _ = get_policy_loss("vanilla")(logprobs=logprobs, old_logprobs=logprobs.detach(),
                                         advantages=adv, response_mask=mask,
                                         agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8)
    lengths = [3, 1, 4, 2]
    torch.testing.assert_close(loss, torch.tensor(-sum(x * n for x, n in zip(a, lengths)) / (4 * 8)))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -torch.tensor(a)[:, None] * mask / 32)
