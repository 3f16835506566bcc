"""The trainer's side of conftest's prompt_logprobs: what the trainer's own model computes for the
same prompts, to compare with what the engine serves."""
from __future__ import annotations

import torch


def trainer_logprobs(model, prompts, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """log p(token_i | tokens_<i) for every prompt token after the first, from a forward pass of the
    Hugging Face `model` (no gradients), as one 1-D float64 tensor. dtype: what the logits are cast to
    before the log-softmax (float64 where a test wants no rounding of its own)."""
    values = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].to(dtype), -1)
            values.append(logp[torch.arange(len(prompt) - 1), ids[0, 1:]])
    return torch.cat(values).double()
