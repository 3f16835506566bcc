"""A model smaller than conftest's tiny ones (those are sized for an engine), for tests of the
trainer's parts alone: batching, the loss's gradients, the training memory."""
from __future__ import annotations

import torch


def one_layer_qwen2():
    """A random fp32 Qwen2 of one layer, vocabulary 64 and hidden size 32. It seeds torch's global
    generator with 0 first: every call gives the same weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).float()
