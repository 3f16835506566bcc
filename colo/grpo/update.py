"""The policy-gradient half of a GRPO step: forward, loss and backward over a packed rollout batch,
in micro-batches whose gradients add up to the gradient of the whole batch's token-level mean."""
from __future__ import annotations

import torch

from .batch import PackedBatch, completion_logprobs
from .config import GRPOConfig
from .loss import grpo_loss


def accumulate_gradients(model, batch: PackedBatch, advantages: torch.Tensor, config: GRPOConfig, *,
                         num_tokens: float | torch.Tensor, reference=None, engine_logprobs: list | None = None,
                         after_forward=None) -> dict:
    """Add d(loss)/d(params) to the parameters' .grad; return loss, clip_fraction, kl and (when the
    engine's log-probabilities are given and temperature is 1) engine_logprob_max_abs_diff and _mean_abs_diff.

    num_tokens: the token count the loss is averaged over (the whole batch, or its share per rank),
    or one denominator per row (loss.loss_denominators: the loss type's).
    The old policy is the current one (one optimizer step per rollout, as TRL does by default):
    the ratio is 1 in value but carries the policy gradient.
    """
    micro = config.micro_batch_size or len(batch)
    local_tokens = max(float(batch.completion_mask.sum()), 1.0)
    loss = clip = kl = mismatch = 0.0
    gap_sum = gap_count = 0.0
    per_row = isinstance(num_tokens, torch.Tensor) and num_tokens.dim() == 1
    for start in range(0, len(batch), micro):
        part = batch.rows(start, start + micro)
        logprobs = completion_logprobs(model, part, config.temperature)
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref = completion_logprobs(reference, part, config.temperature)
        parts = grpo_loss(logprobs, logprobs.detach(), advantages[start:start + micro], part.completion_mask,
                          epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, beta=config.beta,
                          ref_logprobs=ref,
                          num_tokens=num_tokens[start:start + micro].to(logprobs.device) if per_row else num_tokens)
        if after_forward is not None:
            after_forward()  # activations are alive now: the moment to sample memory
        parts.loss.backward()
        weight = float(part.completion_mask.sum()) / local_tokens
        loss += parts.loss.item()
        clip += parts.clip_fraction * weight
        kl += parts.kl_mean * weight
        if engine_logprobs is not None:
            worst, total, count = engine_mismatch(logprobs.detach(), part.attention_mask[:, part.prompt_len:],
                                                  engine_logprobs[start:start + micro])
            mismatch, gap_sum, gap_count = max(mismatch, worst), gap_sum + total, gap_count + count
    stats = {"loss": loss, "clip_fraction": clip, "kl": kl}
    if engine_logprobs is not None:
        stats["engine_logprob_max_abs_diff"] = mismatch
        stats["engine_logprob_abs_diff_sum"], stats["engine_logprob_tokens"] = gap_sum, gap_count
    return stats


def engine_mismatch(trainer_logprobs: torch.Tensor, mask: torch.Tensor, engine_logprobs: list) -> tuple:
    """(largest, sum, count) of |trainer - engine| log-probability over the sampled tokens: proof that
    the engine runs the weights being trained (0 up to kernel differences when the publish is exact).
    vLLM reports raw-logit log-probabilities, so this compares like with like only at temperature 1.
    mask: the completion tokens that exist (truncated ones too, even when left out of the loss)."""
    worst = total = count = 0.0
    for row, sample in enumerate(engine_logprobs):
        if not sample:
            continue
        engine = torch.tensor(sample, dtype=trainer_logprobs.dtype, device=trainer_logprobs.device)
        n = engine.numel()
        diff = (trainer_logprobs[row, :n] - engine).abs() * mask[row, :n]
        worst = max(worst, float(diff.max()))
        total += float(diff.sum())
        count += float(mask[row, :n].sum())
    return worst, total, count
