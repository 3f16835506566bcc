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


# The engine's gap to the trainer on the tokens it sampled, as a step record has it (mean, max), by the
# run's dtype: kernel differences only with one copy (seen: about 1e-5 mean in fp32; 0.03 to 0.06 mean,
# under 1 at most, in bf16 for SmolLM2 and Gemma 3 270M); a stale or mis-laid weight moves log-probs by O(1).
ENGINE_GAP = {"fp32": (1e-3, 1e-2), "bf16": (0.15, 1.5)}


def assert_engine_follows(record: dict) -> None:
    """The step record's engine-vs-trainer gap is rounding in its dtype."""
    mean, largest = ENGINE_GAP[record["dtype"]]
    assert record["engine_logprob_mean_abs_diff"] < mean and record["engine_logprob_max_abs_diff"] < largest, record
