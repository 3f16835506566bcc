"""GRPO advantages and loss against numbers worked out by hand, and the loss's gradient over
micro-batches adding up to the whole batch's (no engine, fast)."""
import math

import pytest
import torch

from colo.grpo.batch import pack
from colo.grpo.config import GRPOConfig
from colo.grpo.loss import ADVANTAGE_EPS, group_advantages, grpo_loss, token_logprobs
from helpers.models import one_layer_qwen2


def test_group_advantages_hand_example():
    # Group 1: rewards 1, 0, 0 -> mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3).
    # Group 2: all equal -> every advantage is exactly 0 (no signal, no division by zero).
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=3)
    std = math.sqrt(1 / 3) + ADVANTAGE_EPS
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_group_advantages_unscaled_and_bad_input():
    assert group_advantages(torch.tensor([3.0, 1.0]), 2, scale=False).tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="positive"):
        group_advantages(torch.tensor([1.0]), 0)


def test_grpo_loss_hand_example_values_and_gradients():
    # Two completions of two tokens; the second completion has one real token (mask 1, 0).
    # old p = 0.5 everywhere; new/old ratios: [1.5, 0.9] and [0.5, 1.0]; advantages +1 and -1; eps 0.2.
    # token (0,0): min(1.5*1, 1.2*1) = 1.2 (clipped)      -> -1.2
    # token (0,1): min(0.9*1, 0.9*1) = 0.9 (unclipped)    -> -0.9
    # token (1,0): min(0.5*-1, 0.8*-1) = -0.8 (clipped)   -> +0.8
    # token-level mean over 3 tokens: (-1.2 - 0.9 + 0.8) / 3
    old = torch.full((2, 2), math.log(0.5))
    ratios = torch.tensor([[1.5, 0.9], [0.5, 1.0]])
    new = (old + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0]])
    parts = grpo_loss(new, old, torch.tensor([1.0, -1.0]), mask)
    assert parts.loss.item() == pytest.approx(-1.3 / 3, abs=1e-6)
    assert parts.clip_fraction == pytest.approx(2 / 3)
    parts.loss.backward()
    # Only the unclipped token carries gradient: d(-ratio * adv / 3)/d logp = -ratio * adv / 3.
    assert new.grad.flatten().tolist() == pytest.approx([0.0, -0.9 / 3, 0.0, 0.0], abs=1e-6)


def test_grpo_loss_kl_term_and_global_token_count():
    logp = torch.zeros(1, 2)
    ref = logp + math.log(2.0)  # k3 estimator: exp(d) - d - 1 = 2 - ln 2 - 1 per token
    parts = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), beta=0.1, ref_logprobs=ref)
    k3 = 1.0 - math.log(2.0)
    assert parts.kl_mean == pytest.approx(k3, abs=1e-6)
    assert parts.loss.item() == pytest.approx(0.1 * k3, abs=1e-6)
    # The same tokens counted against a batch four times larger (other ranks / micro-batches).
    quarter = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), beta=0.1, ref_logprobs=ref, num_tokens=8)
    assert quarter.loss.item() == pytest.approx(0.1 * k3 / 4, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), beta=0.1)
    with pytest.raises(ValueError, match="same shape"):
        grpo_loss(logp, logp[:, :1], torch.tensor([0.0]), torch.ones(1, 2))


def test_token_logprobs_matches_log_softmax_with_temperature():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets, temperature=0.7), expected, atol=1e-5)


def test_micro_batches_add_up_to_the_whole_batch_gradient():
    from colo.grpo.backward import accumulate_gradients

    model = one_layer_qwen2()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    completions = [[11, 12, 13, 14], [15], [16, 17], [18, 19, 20]]
    batch = pack(prompts, completions)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25]), group_size=2)
    tokens = float(batch.completion_mask.sum())

    def gradient(micro_batch_size, beta=0.0, reference=None):
        model.zero_grad(set_to_none=True)
        cfg = GRPOConfig(micro_batch_size=micro_batch_size, beta=beta, temperature=0.8)
        stats = accumulate_gradients(model, batch, advantages, cfg, num_tokens=tokens, reference=reference)
        return torch.cat([p.grad.flatten() for p in model.parameters()]), stats

    whole, whole_stats = gradient(None)
    pieces, piece_stats = gradient(1)
    assert whole.abs().sum() > 0
    assert torch.allclose(whole, pieces, atol=1e-6)
    assert piece_stats["loss"] == pytest.approx(whole_stats["loss"], abs=1e-6)
    # With a KL term against a different reference the loss moves, and still adds up.
    from colo.shared import FrozenCopy

    reference = one_layer_qwen2()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01)
    kl_whole, kl_stats = gradient(None, beta=0.1, reference=FrozenCopy(reference))
    kl_pieces, _ = gradient(3, beta=0.1, reference=FrozenCopy(reference))
    assert kl_stats["kl"] > 0 and not torch.allclose(kl_whole, whole)
    assert torch.allclose(kl_whole, kl_pieces, atol=1e-6)


def test_rows_of_similar_length_train_together_with_the_same_gradient_and_less_padding():
    """backward_rollout's micro-batches (length_buckets): longest first, a row joining while the padded
    micro-batch stays mostly real tokens; the gradient is the one of every row padded alike."""
    from colo.grpo.backward import FILL, backward_rollout, length_buckets
    from colo.grpo.batch import Rollout

    assert length_buckets([4, 4, 4, 4], [30, 2, 28, 3], None) == [[0, 2], [3, 1]]
    assert length_buckets([4, 4, 4, 4], [30, 2, 28, 3], 1) == [[0], [2], [3], [1]]
    assert length_buckets([10, 10, 10], [5, 5, 5], 2) == [[0, 1], [2]]  # equal lengths: the row cap only
    assert length_buckets([10, 10, 10], [5, 5, 5], None, most_positions=30) == [[0, 1], [2]]  # the positions' cap
    assert length_buckets([10], [50], None, most_positions=30) == [[0]]  # a row longer than the cap: alone
    for prompts, completions in (([3, 9, 5, 5, 20], [40, 1, 7, 30, 2]), ([7] * 6, [1, 2, 3, 50, 60, 64])):
        for bucket in length_buckets(prompts, completions, None):
            padded = len(bucket) * (max(prompts[i] for i in bucket) + max(completions[i] for i in bucket))
            assert len(bucket) == 1 or sum(prompts[i] + completions[i] for i in bucket) >= FILL * padded

    model = one_layer_qwen2()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14]]
    completions = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [15], [16, 17], [18, 19, 20], [21] * 9, [22]]
    rollout = Rollout(rows=list(range(6)), prompts=prompts, completions=completions, logprobs=[None] * 6,
                      truncated=[False] * 6)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25, 0.1, 0.9]), group_size=2)
    tokens = float(sum(len(c) for c in completions))

    def gradient(micro_batch_size):
        model.zero_grad(set_to_none=True)
        cfg = GRPOConfig(micro_batch_size=micro_batch_size, temperature=0.8)
        stats = backward_rollout(model, rollout, advantages, cfg, device="cpu", dp_size=1, global_tokens=tokens,
                                 global_sequences=6.0)
        return torch.cat([p.grad.flatten() for p in model.parameters()]), stats

    bucketed, stats = gradient(None)
    one_at_a_time, single = gradient(1)
    torch.testing.assert_close(bucketed, one_at_a_time, atol=1e-6, rtol=1e-5)
    assert stats["loss"] == pytest.approx(single["loss"], abs=1e-6) and single["padded_positions"] == 0
    all_padded = 6 * (max(map(len, prompts)) + max(map(len, completions)))
    assert stats["positions"] < all_padded and stats["padded_positions"] <= (1 - FILL) * stats["positions"]


def test_gradient_checkpointing_gives_the_same_gradient():
    """transformers' gradient checkpointing (as colo.grpo enables it) recomputes the activations in
    backward: the same loss and gradient, chunked head included."""
    from colo.grpo.backward import accumulate_gradients

    batch = pack([[1, 2, 3], [4, 5]], [[11, 12, 13, 14], [15]])
    advantages = torch.tensor([1.0, -1.0])

    def gradient(checkpointing: bool):
        model = one_layer_qwen2().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        stats = accumulate_gradients(model, batch, advantages, GRPOConfig(), num_tokens=5.0)
        return torch.cat([p.grad.flatten() for p in model.parameters()]), stats["loss"], model

    plain, plain_loss, _ = gradient(False)
    recomputed, loss, model = gradient(True)
    assert model.is_gradient_checkpointing and plain.abs().sum() > 0
    assert loss == pytest.approx(plain_loss, abs=1e-7)
    torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-5)


def test_importance_weights_are_the_old_policys_over_the_engines_and_leave_missing_values_uncorrected():
    """TRL's vllm_importance_sampling_correction: rho = pi_old / pi_engine, taken at generation. A later
    optimizer step on the rollout (num_iterations, steps_per_generation) has the current policy's drift
    from the old one in the loss's ratio already: the weights must not count it again. A log-probability
    the engine did not give (None) leaves its token uncorrected (rho 1), as TRL's NaN."""
    from colo.grpo.backward import accumulate_gradients, padded
    from colo.grpo.batch import completion_logprobs

    batch = pack([[1, 2, 3], [4, 5]], [[11, 12, 13, 14], [15, 16]])
    advantages = torch.tensor([1.0, -1.0])
    model = one_layer_qwen2().train()
    with torch.no_grad():
        current = completion_logprobs(model, batch)
    old = [(current[i, :n] - 0.3).tolist() for i, n in enumerate((4, 2))]
    config = GRPOConfig(importance_sampling="token_truncate", importance_sampling_max=3.0)
    stats = accumulate_gradients(model, batch, advantages, config, num_tokens=6.0, engine_logprobs=old,
                                 old_logprobs=old)
    assert stats["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-6)
    engine = [[None] + old[0][1:], None]   # the engine gave no log-probability there, nor any for row 2
    stats = accumulate_gradients(model, batch, advantages, config, num_tokens=6.0, engine_logprobs=engine,
                                 old_logprobs=old)
    assert stats["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-6)
    assert stats["engine_logprob_tokens"] == 3   # the given ones only
    assert torch.isnan(padded(engine, (2, 4), "cpu")[1]).all()
