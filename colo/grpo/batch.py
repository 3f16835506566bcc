"""A rollout batch as the training model sees it, and its per-token log-probabilities.

Layout (as in TRL): prompts left-padded to the longest prompt, completions right-padded to the
longest completion, so every completion starts at the same column and the model only has to
produce logits for the last `completion_len + 1` positions. Position ids are counted from each
sequence's first real token, matching the positions the engine used when it generated them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .images import batched_vision, vision_at_columns
from .logprobs import completion_logprobs_chunked, full_logits_logprobs, has_plain_head
from .prompt_sharing import shared_prompt_logprobs, shares_prompts
from .task import Scores


@dataclass
class PackedBatch:
    input_ids: torch.Tensor        # (B, P + C)
    attention_mask: torch.Tensor   # (B, P + C), 1 for real tokens
    position_ids: torch.Tensor     # (B, P + C)
    completion_ids: torch.Tensor   # (B, C), padding = 0
    completion_mask: torch.Tensor  # (B, C), 1 for the completion tokens the loss counts
    prompt_len: int                # P
    model_tokens: torch.Tensor | None = None  # (B, C), 1 for the tokens the engine sampled (default: completion_mask)
    routes: torch.Tensor | None = None        # (B, P + C, MoE layers, top_k): the engine's experts, -1 where none
    vision: list | None = None                # per row, a vision-language prompt's processor tensors (ImagePrompt.vision)

    def __post_init__(self):
        if self.model_tokens is None:
            self.model_tokens = self.completion_mask.clone()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> "PackedBatch":
        return PackedBatch(self.input_ids[start:stop], self.attention_mask[start:stop],
                           self.position_ids[start:stop], self.completion_ids[start:stop],
                           self.completion_mask[start:stop], self.prompt_len, self.model_tokens[start:stop],
                           None if self.routes is None else self.routes[start:stop],
                           None if self.vision is None else self.vision[start:stop])

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device), self.attention_mask.to(device),
                           self.position_ids.to(device), self.completion_ids.to(device),
                           self.completion_mask.to(device), self.prompt_len, self.model_tokens.to(device),
                           None if self.routes is None else self.routes.to(device),
                           None if self.vision is None else
                           [{key: value.to(device) for key, value in row.items()} for row in self.vision])

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments beyond the tokens: the rows' image tensors, batched."""
        return batched_vision(self.vision) if self.vision is not None else {}


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0,
         loss_masks: list | None = None, routes: list | None = None) -> PackedBatch:
    """One row per (prompt, completion) pair; the two lists have equal length. loss_masks: per completion,
    1 for each token the model sampled and 0 for the tools' (agentic rollouts): those stay in the
    sequence, as context, and out of the loss (None: every completion token counts). routes: per
    completion, a MoE engine's experts of its positions from the prompt's first token on
    ([positions, MoE layers, top_k]), or None."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise ValueError("cannot pack an empty batch")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    prompt_len = max(len(p) for p in prompts)
    completion_len = max(1, max(len(c) for c in completions))
    rows = len(prompts)
    input_ids = torch.full((rows, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, prompt_len - len(p):prompt_len] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, prompt_len - len(p):prompt_len] = 1
        if c:
            input_ids[i, prompt_len:prompt_len + len(c)] = torch.tensor(c, dtype=torch.long)
            attention_mask[i, prompt_len:prompt_len + len(c)] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    completion_mask = attention_mask[:, prompt_len:].clone()
    for i, mask in enumerate(loss_masks or ()):
        if mask is not None:
            if len(mask) != len(completions[i]):
                raise ValueError(f"completion {i}: {len(mask)} loss mask entries for {len(completions[i])} tokens")
            completion_mask[i, :len(mask)] = torch.tensor(mask, dtype=completion_mask.dtype)
    vision = [None if getattr(p, "vision", None) is None else
              vision_at_columns(p.vision, len(p), prompt_len, input_ids.shape[1]) for p in prompts]
    return PackedBatch(input_ids, attention_mask, position_ids, input_ids[:, prompt_len:].clone(),
                       completion_mask, prompt_len, routes=_packed_routes(routes, prompts, input_ids.shape[1]),
                       vision=vision if any(v is not None for v in vision) else None)


def _packed_routes(routes: list | None, prompts: list[list[int]], width: int) -> torch.Tensor | None:
    """Each row's routes at its tokens' columns (prompts end at the same column), -1 elsewhere."""
    if not routes or all(r is None for r in routes):
        return None
    shape = next(r for r in routes if r is not None).shape[1:]
    out = torch.full((len(prompts), width, *shape), -1, dtype=torch.int16)
    prompt_len = max(len(p) for p in prompts)
    for i, (prompt, route) in enumerate(zip(prompts, routes)):
        if route is not None:
            start = prompt_len - len(prompt)
            n = min(route.shape[0], width - start)
            out[i, start:start + n] = route[:n]
    return out


def completion_logprobs(model, batch: PackedBatch, temperature: float = 1.0, entropies: list | None = None,
                        router_logits: list | None = None) -> torch.Tensor:
    """log p(completion token | everything before it) for every completion column, shape (B, C).
    model: a Hugging Face causal LM (Llama/Mistral/Qwen2/Qwen3: logits computed a chunk of tokens at a
    time, colo.grpo.logprobs; rows that share a prompt compute it once, colo.grpo.prompt_sharing), or a
    colo.tensor_parallel.TensorParallelModel (its rank's vocabulary shard of the logits; the
    log-probabilities are over the whole vocabulary)."""
    if hasattr(model, "completion_logprobs"):
        if entropies is not None:
            raise NotImplementedError("token entropies (top_entropy_quantile) of a tensor-parallel model")
        if router_logits is not None:
            raise NotImplementedError("a tensor-parallel model's router logits (the MoE load-balancing loss)")
        return model.completion_logprobs(batch.input_ids, batch.completion_ids, attention_mask=batch.attention_mask,
                                         position_ids=batch.position_ids, temperature=temperature)
    if shares_prompts(model, batch, router_logits is not None):
        return shared_prompt_logprobs(model, batch, temperature, entropies)
    args = (model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids, temperature)
    inputs = batch.model_inputs()
    if has_plain_head(model):
        return completion_logprobs_chunked(*args, model_inputs=inputs, entropies=entropies, router_logits=router_logits)
    return full_logits_logprobs(*args, model_inputs=inputs, entropies=entropies, router_logits=router_logits)


@dataclass
class Rollout:
    """One rank's completions of a step, one entry per completion (prompts repeated per completion)."""
    rows: list[int]                  # the task's row of each completion's prompt
    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list                   # the engine's log-probability of each sampled token
    truncated: list[bool]            # stopped by max_new_tokens, not by EOS
    # Agentic rollouts (colo.grpo.agent), else None: per completion, 1 for the model's tokens and 0 for
    # the tools'; its turns as messages (what reward functions get); its environment instance.
    loss_masks: list | None = None
    conversations: list | None = None
    environments: list | None = None
    extra: list | None = None        # a rollout_func's other fields, one dict per completion
    routes: list | None = None       # a MoE engine's experts per completion (Completion.routes), else None
    # Several optimizer steps on a rollout (steps_per_generation, num_iterations): per completion, the
    # trainer's log-probabilities at the weights it was sampled with, which every step clips against.
    old_logprobs: list | None = None

    def part(self, start: int, stop: int) -> "Rollout":
        cut = lambda values: None if values is None else values[start:stop]  # noqa: E731
        return Rollout(self.rows[start:stop], self.prompts[start:stop], self.completions[start:stop],
                       self.logprobs[start:stop], self.truncated[start:stop], cut(self.loss_masks),
                       cut(self.conversations), cut(self.environments), cut(self.extra), cut(self.routes),
                       cut(self.old_logprobs))

    def select(self, rows: list[int]) -> "Rollout":
        """These rows (indices), in this order."""
        pick = lambda values: None if values is None else [values[i] for i in rows]  # noqa: E731
        return Rollout(pick(self.rows), pick(self.prompts), pick(self.completions), pick(self.logprobs),
                       pick(self.truncated), pick(self.loss_masks), pick(self.conversations), pick(self.environments),
                       pick(self.extra), pick(self.routes), pick(self.old_logprobs))

    def model_tokens(self) -> list[int]:
        """Each completion's tokens the model sampled (the tools' not counted)."""
        if self.loss_masks is None:
            return [len(c) for c in self.completions]
        return [sum(m) for m in self.loss_masks]

    def reward_inputs(self) -> dict:
        """What a task's score() takes beyond the token ids (agentic rollouts: the turns, the environments)."""
        inputs = {}
        if self.conversations is not None:
            inputs["conversations"] = self.conversations
        if self.environments is not None and any(e is not None for e in self.environments):
            inputs["environments"] = self.environments
        if self.extra and self.extra[0]:
            inputs["extra_columns"] = {key: [fields.get(key) for fields in self.extra] for key in self.extra[0]}
        return inputs


def rollout_of(rows, prompts, completions, n: int) -> Rollout:
    """A Rollout of these prompts' completions (engine Completions, n per prompt, prompt after prompt;
    an agentic completion carries its own prompt, loss mask, turns and environment)."""
    agentic = bool(completions) and hasattr(completions[0], "loss_mask")
    prompts = [p for p in prompts for _ in range(n)]
    return Rollout(rows=[r for r in rows for _ in range(n)],
                   prompts=[c.prompt_ids for c in completions] if agentic else prompts,
                   completions=[c.token_ids for c in completions], logprobs=[c.logprobs for c in completions],
                   truncated=[c.truncated for c in completions],
                   loss_masks=[c.loss_mask for c in completions] if agentic else None,
                   conversations=[c.messages for c in completions] if agentic else None,
                   environments=[c.environment for c in completions] if agentic else None,
                   extra=[c.extra for c in completions] if agentic else None,
                   routes=None if agentic or all(getattr(c, "routes", None) is None for c in completions)
                   else [c.routes for c in completions])


def loss_tokens(rollout: Rollout, mask_truncated: bool) -> float:
    """Completion tokens that count in the loss (pack's completion_mask summed)."""
    return float(sum(n for n, cut in zip(rollout.model_tokens(), rollout.truncated) if not (mask_truncated and cut)))


def concatenated_scores(scores: list) -> Scores:
    """Per-group Scores, in prompt order, as the whole batch's."""
    return Scores(torch.cat([s.per_function for s in scores]), scores[0].weights, scores[0].names)
