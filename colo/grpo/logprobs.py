"""Per-token log-probabilities of the completion tokens without a [batch, tokens, vocab] logits tensor.

The straightforward way (`full_logits_logprobs`) asks the model for the logits of every completion
position at once: B x C x vocab in the model's dtype, then an fp32 copy for the log-softmax, and
autograd keeps them for backward. At Qwen2's vocabulary (151936) 8 sequences x 512 tokens are
3.7 GB of logits before backward doubles them.

`completion_logprobs_chunked` runs the decoder once, keeps only the last hidden states of the
completion-predicting positions, and computes the head (the lm_head matmul included) and the
log-softmax over `chunk_tokens` positions at a time, each chunk under activation checkpointing: its
logits are freed as soon as its log-probabilities are out, and backward recomputes them one chunk at a
time. The logits alive at any moment are one chunk's, up to about 4 x chunk_tokens x vocab x 4 bytes
while its backward runs (its logits, their fp32 copy, the log-softmax's and the gather's gradients;
measured: python -m colo.bench --sections logprob_memory), whatever the batch. The cost is one more
head matmul per chunk in backward. The arithmetic is the straightforward way's, row for row (the head
in the model's dtype, then fp32): only float summation order differs, and, for a 16-bit head, that its
weight's gradient is the sum of the chunks' 16-bit gradients (autograd adds them in the weight's
dtype) rather than one matmul's fp32 sum rounded once.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .loss import token_logprobs

# Positions per chunk. A matmul of M rows reads the head's weight (vocab x hidden) once and does M
# multiply-adds per weight element: below ~300 rows a GPU's head matmul waits on memory, not on
# arithmetic (H100 bf16: ~990 TFLOP/s against 3.35 TB/s), so much smaller chunks would slow each step
# down; 256 rows is near that line while one fp32 chunk of logits stays small: 48 MiB at vocab 49152,
# 148 MiB at 151936 (the straightforward way: B x C / 256 times that, kept for backward). Not measured
# on a GPU.
CHUNK_TOKENS = 256

# Causal LMs whose logits are exactly lm_head(decoder(...).last_hidden_state): no softcapping, no
# logit scale. Others take the straightforward way.
PLAIN_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def has_plain_head(model) -> bool:
    config = getattr(model, "config", None)
    return (isinstance(model, torch.nn.Module) and getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
            and isinstance(model.get_output_embeddings(), torch.nn.Linear))


def full_logits_logprobs(model, input_ids, attention_mask, position_ids, completion_ids,
                         temperature: float = 1.0) -> torch.Tensor:
    """The straightforward way: every completion position's logits at once, (B, C) log-probabilities."""
    columns = completion_ids.shape[1]
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=columns + 1, use_cache=False)
    # Logits at column t predict token t + 1: drop the prediction after the last token.
    return token_logprobs(out.logits[:, :-1, :], completion_ids, temperature)


def completion_logprobs_chunked(model, input_ids, attention_mask, position_ids, completion_ids,
                                temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """log p(completion token | everything before it), (B, C) fp32, equal to full_logits_logprobs up to
    float summation order. model: a Hugging Face causal LM with has_plain_head (tied head or not)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    rows, columns = completion_ids.shape
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    # The C positions before each completion token predict it (the columns full_logits_logprobs keeps).
    hidden = hidden[:, -(columns + 1):-1].reshape(rows * columns, -1)
    targets = completion_ids.reshape(-1)
    head = model.get_output_embeddings()
    # One split node: backward concatenates the chunks' hidden-state gradients once, instead of
    # adding a zero-padded full-size gradient per chunk.
    pieces = [_chunk(head, h, t, temperature) for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))]
    return torch.cat(pieces).view(rows, columns)


def _chunk(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    if not torch.is_grad_enabled():  # nothing kept for backward anyway (reference model, evaluation)
        return _head_logprobs(head, hidden, targets, temperature)
    # preserve_rng_state=False: a linear layer and a log-softmax draw no random numbers.
    return checkpoint(_head_logprobs, head, hidden, targets, temperature, use_reentrant=False,
                      preserve_rng_state=False)


def _head_logprobs(head, hidden, targets, temperature):
    # head(hidden) in the model's dtype, then fp32: what full_logits_logprobs computes for these rows.
    return token_logprobs(head(hidden), targets, temperature)
