"""Each prompt computed once a micro-batch: the trainer's forward of GRPO's completions on their shared prompt.

GRPO samples `num_generations` completions of each prompt. Packed one row per completion
(colo.grpo.batch.pack), the trainer's forward runs every prompt once per completion, and its
backward as often. Here the rows of a micro-batch that share a prompt share its forward: the distinct
prompts run once through the decoder into a key/value cache (transformers' DynamicCache, its tensors
kept in the autograd graph), the cache is gathered to one entry per row, and the completions run on
it. Every completion token attends to the same keys and values as in the packed forward, and backward
adds each prompt's gradient over its rows (the gather's backward): the log-probabilities and the
gradient are the packed forward's up to float summation order. The completion's last token, which
predicts nothing, is not computed.

It applies to a causal LM whose logits are its head's (logprobs.has_plain_head) with full attention in
every layer (its cache all DynamicLayer: no sliding window, no linear attention), text prompts, and
no gradient checkpointing (transformers drops the cache under it). A MoE batch that carries the
engine's routes, or whose router logits are asked for, takes the packed forward: its routes and
logits are per packed position. micro_batches() then keeps the rows of a prompt together.
"""
from __future__ import annotations

import torch

from ..model_classes import is_vision_language
from .logprobs import CHUNK_TOKENS, has_plain_head, head_logprobs, trunk


def prompt_cache_fits(model) -> bool:
    """Whether `model`'s forward can run a prompt once for several completions (the module docstring's
    conditions); the cache's layer kinds are read once and kept on the model."""
    if not isinstance(model, torch.nn.Module) or not has_plain_head(model) or \
            is_vision_language(model.config) or getattr(model, "is_gradient_checkpointing", False):
        return False
    known = model.__dict__.get("_colo_full_attention_cache")
    if known is None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        try:
            layers = DynamicCache(config=model.config).layers
        except (TypeError, ValueError, KeyError, AttributeError):  # a config whose layer kinds transformers cannot read
            layers = None
        known = layers is not None and all(type(layer) is DynamicLayer for layer in layers)
        model.__dict__["_colo_full_attention_cache"] = known
    return known


def prompt_groups(batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the first row of each distinct prompt, each row's distinct prompt) of a packed batch, or None
    where no two rows share a prompt (or a row's prompt carries images)."""
    if batch.vision is not None or len(batch) < 2:
        return None
    prompts = torch.cat([batch.input_ids[:, :batch.prompt_len], batch.attention_mask[:, :batch.prompt_len]], 1)
    distinct, inverse = torch.unique(prompts.cpu(), dim=0, return_inverse=True)
    if len(distinct) == len(batch):
        return None
    first = torch.full((len(distinct),), len(batch), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(len(batch)), reduce="amin")
    return first, inverse


def forward_may_share(model, routes, router_logits: bool) -> bool:
    """Whether a forward of `model` on rows carrying the engine's `routes` (or None) may compute their
    shared prompts once; router_logits: whether it must give a MoE model's router logits (both are per
    packed position)."""
    return not router_logits and routes is None and prompt_cache_fits(model)


def shares_prompts(model, batch, router_logits: bool = False) -> bool:
    """Whether completion_logprobs computes `batch`'s prompts once each (shared_prompt_logprobs);
    router_logits: whether the forward must give a MoE model's router logits."""
    return forward_may_share(model, batch.routes, router_logits) and prompt_groups(batch) is not None


def shared_prompt_logprobs(model, batch, temperature: float = 1.0, entropies: list | None = None,
                           chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """log p(completion token | everything before it), (B, C) fp32, as completion_logprobs_chunked gives
    them, each distinct prompt's forward run once (the module docstring)."""
    from transformers import DynamicCache

    first, inverse = prompt_groups(batch)
    device = batch.input_ids.device
    first, inverse = first.to(device), inverse.to(device)
    start = _first_real_column(batch)
    prompt = slice(start, batch.prompt_len)
    cache = DynamicCache(config=model.config)
    decoder = trunk(model)
    prompts = decoder(input_ids=batch.input_ids[first, prompt], attention_mask=batch.attention_mask[first, prompt],
                      position_ids=batch.position_ids[first, prompt], past_key_values=cache, use_cache=True)
    if cache.get_seq_length() != batch.prompt_len - start:
        raise RuntimeError(f"{type(model).__name__}'s forward filled {cache.get_seq_length()} of the prompts' "
                           f"{batch.prompt_len - start} positions into its cache")
    predicting = [prompts.last_hidden_state[:, -1:][inverse]]   # the prompt's last position: the first token's
    columns = batch.completion_ids.shape[1]
    if columns > 1:
        cache.batch_select_indices(inverse)
        body = slice(batch.prompt_len, batch.prompt_len + columns - 1)
        completions = decoder(input_ids=batch.input_ids[:, body],
                              attention_mask=batch.attention_mask[:, start:body.stop],
                              position_ids=batch.position_ids[:, body], past_key_values=cache, use_cache=True)
        predicting.append(completions.last_hidden_state)
    return head_logprobs(model, torch.cat(predicting, 1), batch.completion_ids, temperature, chunk_tokens, entropies)


def _first_real_column(batch) -> int:
    """The first prompt column any row has a token in (columns before it are every row's padding)."""
    real = batch.attention_mask[:, :batch.prompt_len].any(0).nonzero()
    return int(real[0]) if len(real) else 0


def computed_positions(model, batch, router_logits: bool = False) -> tuple[float, float]:
    """(positions the trainer's forward computes for `batch`, how many of those hold padding)."""
    if not shares_prompts(model, batch, router_logits):
        positions = batch.attention_mask.numel()
        return float(positions), float(positions - batch.attention_mask.sum())
    first, _ = prompt_groups(batch)
    start = _first_real_column(batch)
    prompt_mask = batch.attention_mask[first, start:batch.prompt_len]
    completion_mask = batch.attention_mask[:, batch.prompt_len:-1]
    positions = prompt_mask.numel() + completion_mask.numel()
    return float(positions), float(positions - prompt_mask.sum() - completion_mask.sum())


def shared_prompt_buckets(prompts: list[list[int]], completion_lengths: list[int], most_rows: int | None,
                          most_positions: int, fill: float) -> list[list[int]]:
    """The rows (indices) of each micro-batch where each micro-batch's distinct prompts are computed once:
    a prompt's completions, longest first, cut into pieces each at least `fill` real tokens when padded
    (its prompt once, its rows to its longest completion); then the pieces, longest first, joined while
    the micro-batch (its distinct prompts to the longest, its rows to the longest completion) stays `fill`
    full, holds at most `most_rows` rows and at most `most_positions` positions (one row alone may hold
    more)."""
    lengths = [max(c, 1) for c in completion_lengths]

    def fits(rows: list[int]) -> bool:
        distinct = {tuple(prompts[i]) for i in rows}
        padded = len(distinct) * max(map(len, distinct)) + len(rows) * max(lengths[i] for i in rows)
        real = sum(map(len, distinct)) + sum(lengths[i] for i in rows)
        return (most_rows is None or len(rows) <= most_rows) and padded <= most_positions and real >= fill * padded

    def joined(units: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = []
        for unit in units:
            if out and fits(out[-1] + unit):
                out[-1] = out[-1] + unit
            else:
                out.append(list(unit))
        return out

    by_prompt: dict[tuple, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(i)
    pieces = [piece for rows in by_prompt.values()
              for piece in joined([[i] for i in sorted(rows, key=lambda i: (lengths[i], -i), reverse=True)])]
    pieces.sort(key=lambda piece: (len(prompts[piece[0]]) + lengths[piece[0]], -piece[0]), reverse=True)
    return joined(pieces)
