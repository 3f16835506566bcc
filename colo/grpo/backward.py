"""The policy-gradient half of a GRPO step: forward, loss and backward over a rollout (a rank's
batch, or one prompt's group), in micro-batches whose gradients add up to the gradient of the
whole batch's loss."""
from __future__ import annotations

import contextlib

import torch

from ..moe_routing import replay_of
from .batch import PackedBatch, Rollout, completion_logprobs, pack
from .config import GRPOConfig, processed_logprobs
from .loss import grpo_loss, high_entropy_mask, importance_weights, loss_denominators, off_policy_mask
from .prompt_sharing import computed_positions, forward_may_share, shared_prompt_buckets
from .router_aux import RouterAuxLoss, router_aux_loss


def accumulate_gradients(model, batch: PackedBatch, advantages: torch.Tensor, config: GRPOConfig, *,
                         num_tokens: float | torch.Tensor, reference=None, engine_logprobs: list | None = None,
                         after_forward=None, old_logprobs: list | None = None, aux: RouterAuxLoss | None = None,
                         aux_rows: int | None = None) -> dict:
    """Add d(loss)/d(params) to the parameters' .grad; return loss, clip_fraction, kl and (when the
    engine's log-probabilities are given: at temperature 1, or with importance sampling)
    engine_logprob_max_abs_diff and _mean_abs_diff; with config.importance_sampling, the policy term
    of each token is weighted by colo.grpo.loss.importance_weights, and its statistics returned.

    num_tokens: the token count the loss is averaged over (the whole batch, or its share per rank),
    or one denominator per row (loss.loss_denominators: the loss type's).
    old_logprobs: per row, the trainer's log-probabilities at the weights the rollout was sampled with
    (several optimizer steps on a rollout clip against them: rollout_logprobs); None: the old policy is
    the current one (one step per rollout, TRL's default): the ratio is 1 in value but carries the
    policy gradient.
    aux: the MoE load-balancing loss (colo.grpo.router_aux), each micro-batch's weighted by its share of
    `aux_rows` rows (default: this batch's), so that the batch adds their mean; its statistic `aux_loss`.
    """
    micro = config.micro_batch_size or len(batch)
    aux_rows = aux_rows or len(batch)
    aux_sum = 0.0
    local_tokens = max(float(batch.completion_mask.sum()), 1.0)
    replay = replay_of(model) if batch.routes is not None else None
    loss = clip = kl = mismatch = 0.0
    gap_sum = gap_count = 0.0
    sampling = []  # importance sampling's statistics of each micro-batch, with its loss tokens
    per_row = isinstance(num_tokens, torch.Tensor) and num_tokens.dim() == 1
    for start in range(0, len(batch), micro):
        part = batch.rows(start, start + micro)
        with engine_routes(model, part.routes, config):
            entropies = [] if config.top_entropy_quantile < 1.0 else None
            router_logits = [] if aux is not None else None
            logprobs = completion_logprobs(model, part, config.temperature, entropies, router_logits)
            token_mask = None if entropies is None else \
                high_entropy_mask(entropies[0], part.completion_mask, config.top_entropy_quantile)
            ref = None
            if reference is not None:
                with torch.no_grad(), reference.model() as reference_model:
                    ref = completion_logprobs(reference_model, part, config.temperature)
            old = logprobs.detach() if old_logprobs is None else padded(old_logprobs[start:start + micro],
                                                                       logprobs.shape, logprobs.device)
            sampled = None if engine_logprobs is None else \
                padded(engine_logprobs[start:start + micro], logprobs.shape, logprobs.device)
            if config.off_policy_mask_threshold is not None:
                # (the engine's sampling log-probabilities where given, else the old policy's, as TRL)
                keep = off_policy_mask(advantages[start:start + micro], logprobs, old if sampled is None else sampled,
                                       part.completion_mask, config.off_policy_mask_threshold)
                token_mask = keep if token_mask is None else token_mask * keep
            weights = None
            if config.importance_sampling != "off" and sampled is not None:
                # (the old policy's over the engine's, as TRL's: the loss's ratio carries the current policy's
                # drift from the old one, which the weights must not count again)
                weights, is_stats = importance_weights(old, sampled, part.completion_mask, config.importance_sampling,
                                                       config.importance_sampling_min, config.importance_sampling_max)
                sampling.append((is_stats, float(part.completion_mask.sum())))
            parts = grpo_loss(logprobs, old, advantages[start:start + micro], part.completion_mask,
                              epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, beta=config.beta,
                              ref_logprobs=ref, weights=weights, loss_type=config.loss_type,
                              importance_sampling_level=config.importance_sampling_level, delta=config.delta,
                              bias_correction_kl=config.use_bias_correction_kl,
                              sapo_temperature_pos=config.sapo_temperature_pos,
                              sapo_temperature_neg=config.sapo_temperature_neg, token_mask=token_mask,
                              vespo=(config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg,
                                     config.vespo_lambda_neg),
                              num_tokens=num_tokens[start:start + micro].to(logprobs.device) if per_row else num_tokens)
            if after_forward is not None:
                after_forward()  # activations are alive now: the moment to sample memory
            total = parts.loss
            if aux is not None:
                balance = aux.loss(router_logits[0], part.attention_mask)
                total = total + aux.coef * balance * (len(part) / aux_rows)
                aux_sum += float(balance.detach()) * len(part)
            total.backward()
        weight = float(part.completion_mask.sum()) / local_tokens
        loss += parts.loss.item()
        clip += parts.clip_fraction * weight
        kl += parts.kl_mean * weight
        if engine_logprobs is not None:
            worst, total, count = engine_mismatch(logprobs.detach(), part.model_tokens,
                                                  engine_logprobs[start:start + micro])
            mismatch, gap_sum, gap_count = max(mismatch, worst), gap_sum + total, gap_count + count
    stats = {"loss": loss, "clip_fraction": clip, "kl": kl}
    if aux is not None:
        stats["aux_loss"] = aux_sum / len(batch)
    if replay is not None:
        stats.update(replay.stats())
    if engine_logprobs is not None:
        stats["engine_logprob_max_abs_diff"] = mismatch
        stats["engine_logprob_abs_diff_sum"], stats["engine_logprob_tokens"] = gap_sum, gap_count
    if sampling:
        stats.update(merge_sampling(sampling))
    return stats


def padded(rows: list, shape, device) -> torch.Tensor:
    """Per-row lists (or 1-D tensors) of numbers (None: NaN, a value the engine did not give, which
    importance_weights leaves uncorrected; a None row: all NaN; past a row's end: 0) as a (B, C) tensor."""
    out = torch.zeros(shape, dtype=torch.float32)
    for i, row in enumerate(rows):
        if row is None:
            out[i] = float("nan")
        elif isinstance(row, torch.Tensor):
            out[i, :min(row.numel(), shape[1])] = row[:shape[1]].float()
        elif row:
            values = torch.tensor([float("nan") if v is None else v for v in row[:shape[1]]], dtype=torch.float32)
            out[i, :len(values)] = values
    return out.to(device)


def merge_sampling(parts: list[tuple[dict, float]]) -> dict:
    """Importance sampling's statistics of several pieces as one: min and max of theirs, means weighted
    by each piece's loss tokens."""
    tokens = sum(n for _, n in parts) or 1.0
    merged = {}
    for key in parts[0][0]:
        values = [s[key] for s, _ in parts]
        if key.endswith("/min"):
            merged[key] = min(values)
        elif key.endswith("/max"):
            merged[key] = max(values)
        else:
            merged[key] = sum(s[key] * n for s, n in parts) / tokens
    merged["sampling/tokens"] = sum(n for _, n in parts)
    return merged


def engine_mismatch(trainer_logprobs: torch.Tensor, mask: torch.Tensor, engine_logprobs: list) -> tuple:
    """(largest, sum, count) of |trainer - engine| log-probability over the sampled tokens: proof that
    the engine runs the weights being trained (0 up to kernel differences when the publish is exact).
    vLLM reports raw-logit log-probabilities, so this compares like with like only at temperature 1.
    mask: the tokens the engine sampled (truncated ones too, even when left out of the loss; not the
    tools' tokens of an agentic rollout, whose logprobs the engine did not give). A NaN (or None) engine
    log-probability is one the engine did not give: not compared."""
    worst = total = count = 0.0
    for row, sample in enumerate(engine_logprobs):
        if sample is None or len(sample) == 0:
            continue
        engine = padded([sample], (1, len(sample)), trainer_logprobs.device)[0].to(trainer_logprobs.dtype)
        n = engine.numel()
        given = mask[row, :n] * ~torch.isnan(engine)
        diff = torch.nan_to_num((trainer_logprobs[row, :n] - engine).abs()) * given
        worst = max(worst, float(diff.max()))
        total += float(diff.sum())
        count += float(given.sum())
    return worst, total, count


def engine_routes(model, routes, config: GRPOConfig):
    """Where a MoE batch carries the engine's routes: the trainer's routers forced to them
    (routing_replay) or compared with them; otherwise nothing."""
    replay = replay_of(model) if routes is not None else None
    if replay is None:
        return contextlib.nullcontext()
    return (replay.forcing if config.routing_replay else replay.measuring)(routes)


@torch.no_grad()
def rollout_logprobs(model, rollout: Rollout, config: GRPOConfig, *, device,
                     router_logits: bool = False) -> list[torch.Tensor]:
    """Each completion's log-probabilities under the model as it is (no gradient; the micro-batches and
    the forward of backward_rollout, so each row is computed as it will be trained): the old policy of a
    rollout trained over several optimizer steps (steps_per_generation). router_logits: whether training
    asks for the MoE router logits (its load-balancing loss), which decides that forward."""
    kept: list = [None] * len(rollout.completions)
    for rows in micro_batches(model, rollout, config, router_logits=router_logits):
        part = rollout.select(rows)
        batch = pack(part.prompts, part.completions, loss_masks=part.loss_masks, routes=part.routes).to(device)
        with engine_routes(model, batch.routes, config):
            logprobs = completion_logprobs(model, batch, config.temperature,
                                           router_logits=[] if router_logits else None).cpu()
        for i, row in zip(rows, logprobs.unbind(0)):
            kept[i] = row
    return kept


def backward_rollout(model, rollout: Rollout, advantages: torch.Tensor, config: GRPOConfig, *, device,
                     dp_size: int, global_tokens: float, global_sequences: float, reference=None,
                     after_forward=None, aux: RouterAuxLoss | None = None) -> dict:
    """Forward, loss and backward over these completions, their gradients added to the parameters';
    returns the merged statistics (merge_stats). The rows go in micro-batches of similar lengths
    (length_buckets), each packed on its own: padding every row to the batch's longest prompt and
    completion would compute positions that hold nothing (`positions` and `padded_positions` in the
    statistics say how many were computed and how many of those were padding)."""
    parts = []
    for rows in micro_batches(model, rollout, config, router_logits=aux is not None):
        part = rollout.select(rows)
        batch = pack(part.prompts, part.completions, loss_masks=part.loss_masks, routes=part.routes)
        old = None if rollout.old_logprobs is None else [rollout.old_logprobs[i] for i in rows]
        if config.mask_truncated:  # the tokens stay in the sequence; they only stop counting in the loss
            batch.completion_mask[torch.tensor(part.truncated, dtype=torch.bool)] = 0
        batch = batch.to(device)
        # Each row's denominator is its share of the loss type's global one (over data-parallel
        # ranks); averaging the gradients over those ranks then yields the exact global loss.
        denominators = loss_denominators(config.loss_type, batch.completion_mask.cpu(), global_tokens=global_tokens,
                                         global_sequences=global_sequences, max_new_tokens=config.max_new_tokens,
                                         ranks=dp_size)
        # vLLM's log-probabilities are of the distribution it sampled from only at temperature 1, or when
        # it reports processed ones (colo.grpo builds it so for importance sampling and off-policy masking).
        compare = config.temperature == 1.0 or processed_logprobs(config)
        stats = accumulate_gradients(model, batch, advantages[rows].to(device), config,
                                     num_tokens=denominators, reference=reference,
                                     engine_logprobs=part.logprobs if compare else None,
                                     after_forward=after_forward, old_logprobs=old, aux=aux,
                                     aux_rows=len(rollout.rows))
        positions, padded = computed_positions(model, batch, router_logits=aux is not None)
        parts.append({**stats, "rows": float(len(rows)), "tokens": float(batch.completion_mask.sum()),
                      "positions": positions, "padded_positions": padded})
    return merge_stats(parts)


# A row joins a micro-batch while the micro-batch, padded to its longest prompt and longest completion,
# stays at least this full of real tokens; otherwise it starts the next one.
FILL = 0.8
# Positions (rows x padded length) a micro-batch holds at most, unless one row is longer: the activations
# autograd keeps grow with them, and a long rollout's whole batch at once would not fit in memory.
MICRO_BATCH_POSITIONS = 4096


class PolicyTrainer:
    """What a step's strategy trains with (colo.grpo.strategy): forward, loss and backward over a rollout
    on the views' model (backward_rollout), against the reference model where there is one, sampling the
    memory while the activations are alive: as generation's while the engine decodes or the KV cache is
    awake (`generating` is the strategy's to set), as training's otherwise."""

    def __init__(self, views, config: GRPOConfig, *, device, dp_size: int, reference, residency, phases):
        self.views, self.config, self.device, self.dp_size = views, config, device, dp_size
        self.reference, self.residency, self.phases = reference, residency, phases
        self.generating = False
        self.aux = router_aux_loss(views.trainer_model, config.router_aux_loss_coef)

    def old_logprobs(self, rollout: Rollout) -> list[torch.Tensor]:
        """rollout_logprobs of the views' model (in the mode it trains in, as TRL computes them): the policy
        the rollout was sampled from, before any update."""
        return rollout_logprobs(self.views.trainer_model, rollout, self.config, device=self.device,
                                router_logits=self.aux is not None)

    def backward(self, rollout: Rollout, advantages: torch.Tensor, *, after_forward=None, **totals) -> dict:
        """backward_rollout over `rollout`; after_forward(): run too, once per micro-batch's forward."""
        def forward_done():
            awake = self.generating or (self.phases.on and self.phases.kv_cache_awake)
            self.residency.sample("generate" if awake else "train")
            if after_forward is not None:
                after_forward()

        return backward_rollout(self.views.trainer_model, rollout, advantages, self.config, device=self.device,
                                dp_size=self.dp_size, reference=self.reference, after_forward=forward_done,
                                aux=self.aux, **totals)


def micro_batches(model, rollout: Rollout, config: GRPOConfig, router_logits: bool = False) -> list[list[int]]:
    """The rows (indices) of each micro-batch `model` trains on: where its forward computes a prompt once
    for the rows sharing it (colo.grpo.prompt_sharing), shared_prompt_buckets, else length_buckets.
    router_logits: whether the forward must give a MoE model's router logits."""
    completions = [len(c) for c in rollout.completions]
    if forward_may_share(model, rollout.routes, router_logits):
        return shared_prompt_buckets(rollout.prompts, completions, config.micro_batch_size, MICRO_BATCH_POSITIONS,
                                     FILL)
    return length_buckets([len(p) for p in rollout.prompts], completions, config.micro_batch_size)


def length_buckets(prompt_lengths: list[int], completion_lengths: list[int], most_rows: int | None,
                   most_positions: int = MICRO_BATCH_POSITIONS) -> list[list[int]]:
    """The rows (indices) of each micro-batch: longest first, a row joining the current micro-batch while
    that one stays FILL full of real tokens when padded (every row to its longest prompt and its longest
    completion, the layout colo.grpo.batch.pack makes), holds at most `most_rows` rows (None: no limit)
    and, padded, at most `most_positions` positions."""
    order = sorted(range(len(prompt_lengths)), key=lambda i: (prompt_lengths[i] + completion_lengths[i], -i),
                   reverse=True)
    buckets: list[list[int]] = []
    longest_p = longest_c = real = 0
    for i in order:
        p, c = prompt_lengths[i], max(completion_lengths[i], 1)
        if buckets and (most_rows is None or len(buckets[-1]) < most_rows):
            padded = (len(buckets[-1]) + 1) * (max(longest_p, p) + max(longest_c, c))
            if real + p + c >= FILL * padded and padded <= most_positions:
                buckets[-1].append(i)
                longest_p, longest_c, real = max(longest_p, p), max(longest_c, c), real + p + c
                continue
        buckets.append([i])
        longest_p, longest_c, real = p, c, p + c
    return buckets


def merge_stats(results: list[dict]) -> dict:
    """accumulate_gradients' statistics of every group as one batch's: loss and sums add up, the
    token-weighted means (clip fraction, KL) weigh each group by its loss tokens (`tokens`)."""
    tokens = sum(r["tokens"] for r in results)
    merged = {"loss": sum(r["loss"] for r in results), "tokens": tokens,
              "positions": sum(r.get("positions", 0.0) for r in results),
              "padded_positions": sum(r.get("padded_positions", 0.0) for r in results),
              "clip_fraction": sum(r["clip_fraction"] * r["tokens"] for r in results) / max(tokens, 1.0),
              "kl": sum(r["kl"] * r["tokens"] for r in results) / max(tokens, 1.0)}
    balanced = [r for r in results if "aux_loss" in r]
    if balanced:  # the MoE load-balancing loss: the mean over the rows
        merged["aux_loss"] = sum(r["aux_loss"] * r.get("rows", 1.0) for r in balanced) / \
            max(sum(r.get("rows", 1.0) for r in balanced), 1.0)
    if results and "engine_logprob_max_abs_diff" in results[0]:
        merged["engine_logprob_max_abs_diff"] = max(r["engine_logprob_max_abs_diff"] for r in results)
        for key in ("engine_logprob_abs_diff_sum", "engine_logprob_tokens"):
            merged[key] = sum(r[key] for r in results)
    routed = [r for r in results if "router_compared" in r]
    if routed:  # the share of (token, MoE layer) pairs whose experts differed between engine and trainer
        merged["router_compared"] = sum(r["router_compared"] for r in routed)
        merged["router_mismatch"] = (sum(r["router_mismatch"] * r["router_compared"] for r in routed)
                                     / max(merged["router_compared"], 1))
    sampled = [r for r in results if "sampling/tokens" in r]
    if sampled:
        merged.update(merge_sampling([({k: v for k, v in r.items() if k.startswith("sampling/") and k != "sampling/tokens"},
                                       r["sampling/tokens"]) for r in sampled]))
    return merged
