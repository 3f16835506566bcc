"""GRPO's arithmetic: group-normalised advantages, per-token log-probabilities and the clipped loss.

Pure tensor functions, no engine and no pool, so they can be checked against a hand computation.
Conventions follow TRL's GRPOTrainer (the reference users compare against): the group std is the
unbiased one (Bessel's correction), the KL term is the k3 estimator exp(ref - new) - (ref - new) - 1,
and the loss is a token-level mean over every completion token of the batch (DAPO-style), so long
completions are not down-weighted relative to short ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int

ADVANTAGE_EPS = 1e-4  # keeps a group whose rewards are all equal at advantage 0 instead of 0/0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """(reward - mean of its group) / (std of its group + eps), for rewards laid out group after group.

    rewards: shape (num_prompts * group_size,), the completions of prompt i at [i*G, (i+1)*G).
    scale=False returns only the centred rewards (Dr. GRPO drops the std division).
    """
    check_int(group_size, "group_size")
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or infinity; the reward function must return finite numbers")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return centred.reshape(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), without materialising a full log_softmax copy.

    logits: (..., vocab); targets: (...) token ids. Temperature must match the one the engine sampled
    with, or the ratio compares two different distributions.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@dataclass
class LossParts:
    loss: torch.Tensor        # the scalar to backpropagate
    clip_fraction: float      # share of tokens where the clipped branch was taken
    kl_mean: float            # mean per-token KL to the reference (0 when beta == 0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
) -> LossParts:
    """The GRPO objective, negated for minimisation, as a token-level mean.

    logprobs, old_logprobs, ref_logprobs, mask: (batch, completion_len); advantages: (batch,).
    num_tokens: the denominator of the mean. Default mask.sum(); pass the token count of the whole
    (multi-rank, multi-micro-batch) batch so summing the pieces' gradients gives the exact global mean.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must have the same shape")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have shape ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs (log-probabilities under the reference model)")
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    unclipped_obj, clipped_obj = ratio * adv, clipped * adv
    per_token = -torch.min(unclipped_obj, clipped_obj)
    kl_mean = 0.0
    if beta != 0.0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + beta * kl
        kl_mean = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1.0))
    denominator = float(mask.sum()) if num_tokens is None else float(num_tokens)
    loss = (per_token * mask).sum() / max(denominator, 1.0)
    took_clip = (clipped_obj < unclipped_obj).to(mask.dtype) * mask
    clip_fraction = float(took_clip.sum() / mask.sum().clamp(min=1.0))
    return LossParts(loss=loss, clip_fraction=clip_fraction, kl_mean=kl_mean)
