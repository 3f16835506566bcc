"""GRPO's arithmetic: group-normalised advantages, per-token log-probabilities and the clipped loss.

Pure tensor functions, no engine and no pool, so they can be checked against a hand computation.
Conventions follow TRL's GRPOTrainer (the reference users compare against): the group std is the
unbiased one (Bessel's correction), the KL term is the k3 estimator exp(ref - new) - (ref - new) - 1,
and the loss is a token-level mean over every completion token of the batch (DAPO-style), so long
completions are not down-weighted relative to short ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_int
from .config import LOSS_TYPES, SCALES

ADVANTAGE_EPS = 1e-4  # keeps a group whose rewards are all equal at advantage 0 instead of 0/0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool | str = "group", *,
                     allow_unscorable: bool = False, batch_std: float | None = None) -> torch.Tensor:
    """(reward - mean of its group) / (std + eps), for rewards laid out group after group (TRL's rule).

    rewards: shape (num_prompts * group_size,), the completions of prompt i at [i*G, (i+1)*G).
    scale: "group" (or True) divides by the group's std, "batch" by the std of the whole batch
    (`batch_std`, e.g. over every rank; default: of these rewards), "none" (or False, Dr. GRPO) not at all.
    allow_unscorable: NaN marks a completion no reward function could score (TRL: all returned None);
    it is left out of its group's mean and std and gets advantage 0. Otherwise NaN is an error.
    """
    check_int(group_size, "group_size")
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    if torch.isinf(rewards).any() or (not allow_unscorable and torch.isnan(rewards).any()):
        raise ValueError("rewards contain NaN or infinity; the reward function must return finite numbers")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.nanmean(dim=1, keepdim=True)
    if scale == "group" and group_size > 1:
        centred = centred / (nanstd(grouped, dim=1, keepdim=True) + ADVANTAGE_EPS)
    elif scale == "batch" and rewards.numel() > 1:
        centred = centred / ((nanstd(rewards) if batch_std is None else batch_std) + ADVANTAGE_EPS)
    return torch.nan_to_num(centred.reshape(-1), nan=0.0)


def normalized_sum(per_function: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """TRL's multi_objective_aggregation="normalize_then_sum" (GDPO), its first half: each reward
    function's rewards normalized within their group ((r - mean) / (std + eps), NaN left out), then
    their weighted sum; NaN where no function scored the completion. The caller normalizes the sums
    over the whole batch (group_advantages' scale="batch" after centring on the batch mean)."""
    check_int(group_size, "group_size")
    functions = per_function.shape[1]
    grouped = per_function.view(-1, group_size, functions)
    mean = grouped.nanmean(dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + ADVANTAGE_EPS)).view(-1, functions)
    sums = (normalized * weights.to(normalized).unsqueeze(0)).nansum(dim=1)
    sums[torch.isnan(per_function).all(dim=1)] = float("nan")
    return sums


def batch_advantages(rewards: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """(r - the batch's mean) / (the batch's std + eps), 0 where r is NaN (unscorable); mean and std of
    every rank's batch (colo.grpo.metrics.scored_mean_std)."""
    return torch.nan_to_num((rewards - mean) / (std + ADVANTAGE_EPS), nan=0.0)


def nanstd(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased std over the non-NaN entries (TRL's nanstd); NaN where fewer than two."""
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    mean = x.nanmean(dim=dim, keepdim=True) if dim is not None else x.nanmean()
    squares = ((x - mean) ** 2).nansum(dim=dim, keepdim=True) if dim is not None else ((x - mean) ** 2).nansum()
    std = (squares / (count - 1)).sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


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
    num_tokens: float | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    delta: float | None = None,
    bias_correction_kl: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    token_mask: torch.Tensor | None = None,
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
) -> LossParts:
    """The GRPO objective, negated for minimisation, as a token-level mean.

    logprobs, old_logprobs, ref_logprobs, mask: (batch, completion_len); advantages: (batch,).
    num_tokens: the denominator of the mean. Default mask.sum(); pass the token count of the whole
    (multi-rank, multi-micro-batch) batch so summing the pieces' gradients gives the exact global mean.
    A (batch,) tensor gives each row its own denominator (loss_denominators: TRL's loss types).
    weights: importance-sampling weights multiplying the policy term, (batch, completion_len) or (batch, 1)
    (importance_weights), before the KL term is added, as TRL applies them.

    The rest are TRL's settings of the same names (trl/trainer/grpo_trainer.py, `_compute_loss`), with
    its defaults. loss_type picks the per-token objective here (the denominators are loss_denominators'):
    the clipped ratio for grpo, bnpo, dr_grpo, dapo and luspo; `cispo` the clipped-and-detached ratio
    times the log-probability; `sapo` a soft gate sigmoid(tau (r - 1)) 4 / tau, tau by the advantage's
    sign. importance_sampling_level "sequence" (GSPO) takes one ratio per sequence, exp of its tokens'
    mean log-ratio. delta: two-sided clipping (the unclipped ratio capped at delta). bias_correction_kl:
    the KL term times the ratio, so its gradient is that of the sampled policy's KL. token_mask: the
    tokens whose policy term counts (high_entropy_mask: top_entropy_quantile); the KL term and the
    denominators keep every token of `mask`, as in TRL. `vespo`: its (k_pos, lambda_pos, k_neg,
    lambda_neg); VESPO weighs each sequence's log-probability gradient by gamma_weights, which take the
    importance-sampling `weights` into the sequence's ratio instead of multiplying the loss by them.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must have the same shape")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have shape ({logprobs.shape[0]},), got {tuple(advantages.shape)}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs (log-probabilities under the reference model)")
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped_obj, clipped_obj = ratio * adv, clipped * adv  # (the clip statistic's, whatever the objective)
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logprobs
    elif loss_type == "vespo":
        phi = gamma_weights(advantages.to(logprobs.dtype).unsqueeze(1), logprobs - old_logprobs, mask, weights,
                            *vespo)
        per_token = -phi * adv * logprobs
        weights = None   # in phi already
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif loss_type in LOSS_TYPES:
        capped = ratio if delta is None else torch.clamp(ratio, max=delta)
        per_token = -torch.min(capped * adv, clipped_obj)
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    per_token = per_token.expand_as(logprobs)
    if token_mask is not None:
        per_token = per_token * token_mask.to(per_token.dtype)
    if weights is not None:
        per_token = per_token * weights.to(per_token.dtype)
    kl_mean = 0.0
    if beta != 0.0:
        gap = ref_logprobs - logprobs
        kl = torch.exp(gap) - gap - 1.0
        per_token = per_token + beta * (kl * ratio if bias_correction_kl else kl)
        kl_mean = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1.0))
    if isinstance(num_tokens, torch.Tensor) and num_tokens.dim() == 1:
        loss = ((per_token * mask).sum(dim=1) / num_tokens.to(per_token).clamp(min=1.0)).sum()
    else:
        denominator = float(mask.sum()) if num_tokens is None else float(num_tokens)
        loss = (per_token * mask).sum() / max(denominator, 1.0)
    took_clip = (clipped_obj < unclipped_obj).to(mask.dtype).expand_as(mask) * mask
    clip_fraction = float(took_clip.sum() / mask.sum().clamp(min=1.0))
    return LossParts(loss=loss, clip_fraction=clip_fraction, kl_mean=kl_mean)


@torch.no_grad()
def gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  importance_weights: torch.Tensor | None, k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> torch.Tensor:
    """VESPO's phi(w) = e^lambda w^k e^(-lambda w) of each sequence's ratio w (the sum of its tokens'
    log-ratios, and of the importance-sampling weights' logs where given), k and lambda by the
    advantage's sign; (B, 1), no gradient (TRL's get_gamma_weights)."""
    lower = math.log(1e-8)
    log_w = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    if importance_weights is not None:
        log_w = log_w + torch.sum(torch.clamp(torch.log(importance_weights), lower, 20.0), dim=-1, keepdim=True)
    log_w = torch.clamp(log_w, lower, 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, k_pos, k_neg)
    lam = torch.where(nonnegative, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """TRL's get_high_entropy_mask: the tokens (of `mask`) whose entropy is at least the (1 - quantile)
    quantile of the entropies of `mask`'s tokens; all False where `mask` has none."""
    counted = entropies[mask.bool()].float()
    if counted.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(counted, 1.0 - quantile)
    return ((entropies * mask.float()) >= threshold) & mask.bool()


# The loss types whose denominator is the batch's token count; every other one's is proportional to
# its number of sequences (loss_denominators).
TOKEN_MEAN_LOSSES = ("dapo", "cispo", "bnpo", "vespo")


def batch_total(loss_type: str, global_tokens: float, global_sequences: float) -> float:
    """The batch count `loss_type`'s denominators are proportional to: a loss summed with that count
    set to `ranks` (denominators of 1 token or 1 sequence) is the true one times ranks / this."""
    return global_tokens if loss_type in TOKEN_MEAN_LOSSES else global_sequences


def loss_denominators(loss_type: str, completion_mask: torch.Tensor, *, global_tokens: float,
                      global_sequences: float, max_new_tokens: int, ranks: int = 1) -> torch.Tensor:
    """Each row's denominator in the loss, so that summing every row's (masked token sum / denominator)
    over micro-batches, then averaging over `ranks` data-parallel ranks, gives TRL's loss exactly:

    grpo, sapo   mean over sequences of each sequence's token mean  -> |o_i| * sequences
    dapo, cispo, vespo  token mean over the whole batch (dapo: TRL's default) -> tokens
    bnpo         token mean of the batch: TRL's is per micro-batch, here over the whole batch as dapo's
                 (equal where the batch is one micro-batch)            -> tokens
    dr_grpo      token sum over sequences x max completion length    -> sequences * max_new_tokens
    luspo        each sequence's token sum, the mean over sequences  -> sequences
    (global_*: counted over every rank; the gradient average over ranks divides by `ranks` again.)
    """
    rows = completion_mask.shape[0]
    if loss_type in TOKEN_MEAN_LOSSES:
        return torch.full((rows,), global_tokens / ranks)
    if loss_type == "luspo":
        return torch.full((rows,), global_sequences / ranks)
    if loss_type in ("grpo", "sapo"):
        return completion_mask.sum(dim=1).float().clamp(min=1.0) * (global_sequences / ranks)
    if loss_type == "dr_grpo":
        return torch.full((rows,), global_sequences * max_new_tokens / ranks)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def off_policy_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL's off-policy sequence mask (OPSM, DeepSeek-V3.2): (B, 1), 0 for a completion with a negative
    advantage whose mean per-token KL from the sampling log-probabilities to `logprobs` exceeds
    `threshold`, 1 otherwise. A token the engine gave no log-probability for (NaN) counts 0."""
    mask = mask.to(torch.float32)
    kl = torch.nan_to_num(sampling_logprobs.float() - logprobs.detach().float(), nan=0.0)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages.reshape(-1, 1) >= 0) | (mean_kl <= threshold)).to(torch.float32)


def importance_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str, low: float | None = None, high: float | None = None) -> tuple[torch.Tensor, dict]:
    """Importance-sampling weights correcting for the engine sampling from (slightly) other numbers than
    the trainer computes, as TRL's vllm_importance_sampling_correction: per token (`token_*`, shape (B, C))
    rho = exp(trainer - engine), per sequence (`sequence_*`, (B, 1)) rho = exp(sum over its tokens);
    `*_truncate` clamps rho to [low, high], `*_mask` sets it to 0 outside. Only tokens of `mask` (the model's,
    in the loss) count. Returns the weights (no gradient) and their statistics (TRL's names)."""
    mask = mask.to(torch.float32)
    diff = torch.nan_to_num((trainer_logprobs.detach().float() - engine_logprobs.float()) * mask, nan=0.0)
    ratio = diff.exp() if mode.startswith("token") else diff.sum(dim=1, keepdim=True).exp()
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        outside = torch.zeros_like(ratio, dtype=torch.bool)
        if low is not None:
            outside |= ratio < low
        if high is not None:
            outside |= ratio > high
        ratio = ratio.masked_fill(outside, 0.0)
    counted = mask.bool() if mode.startswith("token") else mask.sum(dim=1, keepdim=True) > 0
    values = ratio[counted] if counted.any() else ratio.new_ones(1)
    gaps = diff.abs()[mask.bool()] if mask.any() else diff.new_zeros(1)
    stats = {"sampling/importance_sampling_ratio/min": float(values.min()),
             "sampling/importance_sampling_ratio/mean": float(values.mean()),
             "sampling/importance_sampling_ratio/max": float(values.max()),
             "sampling/sampling_logp_difference/mean": float(gaps.mean()),
             "sampling/sampling_logp_difference/max": float(gaps.max())}
    return ratio, stats
