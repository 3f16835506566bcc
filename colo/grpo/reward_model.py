"""A reward model as a reward function (TRL's reward_funcs given a model id): a sequence classifier
with one label, its own tokenizer and chat template, scoring prompt + completion; the score is its
logit, as TRL takes it (`logits[:, 0]`).

Its weights live in a region of the run's pool (`reward_model`, `reward_model_1`, ...) and sleep,
offloaded, while the engine generates and the policy trains: they wake only for the moment the
completions are scored (`attach(pool)`, done by the scheduler once the pool exists; before that the
model scores from where transformers loaded it).
"""
from __future__ import annotations

from pathlib import Path

import torch


def check_reward_model(name_or_dir) -> Path:
    """The reward model's directory, its config checked (a one-label sequence classifier), no weights read."""
    from ..hub import resolve_model
    from .config import read_model_config

    directory = resolve_model(str(name_or_dir))
    try:
        config = read_model_config(directory)
    except ValueError as e:
        raise ValueError(f"reward model {name_or_dir}: {e}") from e
    architectures = list(getattr(config, "architectures", None) or ())
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"reward model {name_or_dir}: {architectures[0] if architectures else config.model_type} "
                         "is not a sequence classifier (a reward model is a *ForSequenceClassification "
                         "checkpoint with one label)")
    if getattr(config, "num_labels", 1) != 1:
        raise ValueError(f"reward model {name_or_dir}: {config.num_labels} labels; a reward model has one")
    return directory


def attach_reward_models(reward_funcs, pool) -> list[str]:
    """Put every RewardModel among `reward_funcs` into a region of `pool`, asleep; their region names."""
    names = []
    for function in reward_funcs:
        if isinstance(function, RewardModel) and function.region is None:
            name = "reward_model" if not names else f"reward_model_{len(names)}"
            function.attach(pool, name)
            names.append(name)
    return names


class RewardModel:
    """reward_funcs entry: RewardModel("DIR" or "ORG/NAME"); called as TRL calls reward functions."""

    def __init__(self, name_or_dir, *, batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        directory = check_reward_model(name_or_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.__name__ = Path(str(name_or_dir).rstrip("/")).name   # the record's rewards/<name>
        self.batch_size = batch_size
        self.region = None

    def attach(self, pool, name: str = "reward_model") -> None:
        """Move the weights into a region of `pool` (on its device), asleep until the next scoring."""
        tensors = [t for t in (*self.model.parameters(), *self.model.buffers())]
        budget = sum(-(-t.nbytes // 256) * 256 for t in tensors)  # each tensor aligned to 256 bytes
        self.region = pool.region(name, budget)
        with torch.no_grad():
            for t in tensors:
                placed = self.region.empty(t.shape, t.dtype)
                placed.copy_(t)
                t.data = placed
        self.region.sleep(offload=True)

    def texts(self, prompts, completions) -> list[str]:
        """Prompt + completion as the reward model reads them: its chat template over the messages of
        a conversational pair, the concatenated text otherwise (TRL's rule)."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, list) and isinstance(completion, list):
                out.append(self.tokenizer.apply_chat_template(prompt + completion, tokenize=False))
            else:
                out.append(f"{prompt}{completion}")
        return out

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        if self.region is not None:
            self.region.wake()
        try:
            device = next(self.model.parameters()).device
            scores = []
            texts = self.texts(prompts, completions)
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                       padding_side="right", add_special_tokens=False).to(device)
                scores += self.model(**batch).logits[:, 0].float().tolist()
            return scores
        finally:
            if self.region is not None:
                self.region.sleep(offload=True)
