"""The Engine's forward-only passes (ref, old_log_prob, values): what they leave undone."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def test_a_forward_only_pass_does_not_read_its_logits_for_the_placeholder_loss(single_rank_ctx):
    """compute_logprobs' micro-batches hand Megatron's schedule a constant zero as their loss:
    summing the logits for it read the largest activation of the pass once more."""
    from hybridflow.config import ModelConfig, ParallelConfig
    from hybridflow.engine import Engine
    from tests.dist.test_parallel_parity import _global_batch

    vocab = 50
    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                        num_query_groups=2, vocab_size=vocab)
    eng = Engine(role="ref", model_cfg=model, ctx=single_rank_ctx, parallel=ParallelConfig(),
                 precision="fp32")

    class WholeSums(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.sum.default and args[0].shape[-1:] == (vocab,):
                WholeSums.seen += 1
            return func(*args, **(kwargs or {}))

    with WholeSums():
        logprobs = eng.compute_logprobs(_global_batch(), micro_batch_size=4)
    assert WholeSums.seen == 0 and torch.isfinite(logprobs).all()


def test_host_work_runs_once_after_the_pass_is_launched(single_rank_ctx, monkeypatch):
    """compute_logprobs / compute_values' `host_work` (reward.score_in_pass) runs once, after
    the pass's schedule returned and before the result is copied to the host, and changes
    nothing the pass returns."""
    from hybridflow.config import ModelConfig, ParallelConfig
    from hybridflow.engine import Engine
    from tests.dist.test_parallel_parity import _global_batch

    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                        num_query_groups=2, vocab_size=50)
    batch = _global_batch()
    for role, method in (("ref", "compute_logprobs"), ("critic", "compute_values")):
        eng = Engine(role=role, model_cfg=model, ctx=single_rank_ctx, parallel=ParallelConfig(),
                     precision="fp32")
        events = []
        run = eng._run
        monkeypatch.setattr(eng, "_run", lambda *a, **kw: (events.append("pass"), run(*a, **kw))[1])
        plain = getattr(eng, method)(batch, micro_batch_size=4)
        events.clear()
        got = getattr(eng, method)(batch, micro_batch_size=4,
                                   host_work=lambda: events.append("host work"))
        assert events == ["pass", "host work"], (role, events)
        assert torch.equal(got, plain) and got.device.type == "cpu"


def test_a_failing_rule_in_a_pass_names_the_reward_stage():
    """reward.score_in_pass: a rule that raises inside the reference pass's host work is reported
    as the reward stage's failure (hybridflow.watchdog), not the pass's."""
    import pytest

    from hybridflow import watchdog
    from hybridflow.rollout.stage import PendingScores

    def rule():
        raise ZeroDivisionError("the rule's own bug")

    pending = PendingScores(stage=None, batch=None, work=rule)
    with pytest.raises(ZeroDivisionError) as err:
        with watchdog.stage("ref"):
            pending.run()
    assert err.value.hybridflow_stage[0] == "reward"
