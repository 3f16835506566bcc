"""A task with a verifiable reward that a tiny random model visibly learns in a few dozen steps on CPU.

Prompts are random token ids; the reward of a completion is the fraction of its tokens that obey a
token rule (id divisible by `modulus`). A random policy scores about 1/modulus; a policy that learned
the rule scores near 1. No tokenizer is involved, so it works with any causal LM's vocabulary.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


class ToyTask:
    """Random prompts and the rule reward. Prompts depend only on (seed, step), so a resumed run
    sees exactly the prompts the interrupted one would have seen."""

    def __init__(self, vocab_size: int, prompt_len: int = 8, modulus: int = 4, seed: int = 0):
        if vocab_size < 2 * modulus:
            raise ValueError(f"vocab_size {vocab_size} is too small for a rule with modulus {modulus}")
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
        self.vocab_size, self.prompt_len, self.modulus, self.seed = vocab_size, prompt_len, modulus, seed

    def prompts(self, step: int, count: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(0, self.vocab_size, (count, self.prompt_len), generator=gen)
        return ids.tolist()

    def rewards(self, prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
        return [sum(1 for t in c if t % self.modulus == 0) / len(c) if c else 0.0 for c in completions]

    def __call__(self, prompts, completions):
        return self.rewards(prompts, completions)


def build_toy_model(directory: str | Path, *, seed: int = 0, vocab_size: int = 512, hidden_size: int = 128,
                    num_layers: int = 2, num_heads: int = 2, num_kv_heads: int = 1,
                    max_len: int = 256) -> Path:
    """Write a small random Qwen2 model (config + safetensors) to `directory` and return it.

    head_dim is 64 because vLLM's CPU attention supports only a few head sizes (32, 64, 80, ...).
    Skips the work when a model already exists there.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_len, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    if (directory / "config.json").exists() and any(directory.glob("*.safetensors")):
        return directory  # built by an earlier run (or by rank 0 of this one); same seed, same weights
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # Write beside the target and rename, so a run killed mid-write never leaves half a model.
    staging = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)
    return directory


def long_tail_toy_task(vocab_size: int = 512, mean_length: int = 32, seed: int = 0):
    """The toy task with completions of very different lengths, as real reasoning tasks have: a
    completion ends at any of vocab_size / mean_length stop tokens, so on a random model its length is
    about geometric with that mean (one batch of 128 holds completions of a few tokens and of five
    times the mean), and a step's generation ends in a tail of a few long ones. The stop tokens break
    the rule the reward counts (id % 4 == 1), so learning it also lengthens completions a little."""
    from .task import CallableTask

    toy = ToyTask(vocab_size, seed=seed)
    task = CallableTask(toy.prompts, toy.rewards)
    count = max(1, vocab_size // mean_length)
    task.stop_token_ids = tuple(range(1, vocab_size, 4))[:count]
    return task
