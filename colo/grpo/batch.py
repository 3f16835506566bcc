"""A rollout batch as the training model sees it, and its per-token log-probabilities.

Layout (as in TRL): prompts left-padded to the longest prompt, completions right-padded to the
longest completion, so every completion starts at the same column and the model only has to
produce logits for the last `completion_len + 1` positions. Position ids are counted from each
sequence's first real token, matching the positions the engine used when it generated them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .logprobs import completion_logprobs_chunked, full_logits_logprobs, has_plain_head


@dataclass
class PackedBatch:
    input_ids: torch.Tensor        # (B, P + C)
    attention_mask: torch.Tensor   # (B, P + C), 1 for real tokens
    position_ids: torch.Tensor     # (B, P + C)
    completion_ids: torch.Tensor   # (B, C), padding = 0
    completion_mask: torch.Tensor  # (B, C), 1 for real completion tokens
    prompt_len: int                # P

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> "PackedBatch":
        return PackedBatch(self.input_ids[start:stop], self.attention_mask[start:stop],
                           self.position_ids[start:stop], self.completion_ids[start:stop],
                           self.completion_mask[start:stop], self.prompt_len)

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device), self.attention_mask.to(device),
                           self.position_ids.to(device), self.completion_ids.to(device),
                           self.completion_mask.to(device), self.prompt_len)


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0) -> PackedBatch:
    """One row per (prompt, completion) pair; the two lists have equal length."""
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
    return PackedBatch(input_ids, attention_mask, position_ids, input_ids[:, prompt_len:].clone(),
                       attention_mask[:, prompt_len:].clone(), prompt_len)


def completion_logprobs(model, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """log p(completion token | everything before it) for every completion column, shape (B, C).
    model: a Hugging Face causal LM (Llama/Mistral/Qwen2/Qwen3: logits computed a chunk of tokens at a
    time, colo.grpo.logprobs), colo.lora's base_model() of one, or a
    colo.tensor_parallel.TensorParallelModel (its rank's vocabulary shard of the logits; the
    log-probabilities are over the whole vocabulary)."""
    if hasattr(model, "completion_logprobs"):
        return model.completion_logprobs(batch.input_ids, batch.completion_ids, attention_mask=batch.attention_mask,
                                         position_ids=batch.position_ids, temperature=temperature)
    if hasattr(model, "as_model"):  # colo.lora's base_model(): the same model with its adapter off
        with model.as_model() as hf_model:
            return completion_logprobs(hf_model, batch, temperature)
    args = (model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids, temperature)
    return completion_logprobs_chunked(*args) if has_plain_head(model) else full_logits_logprobs(*args)
