"""Randomly initialised causal LMs for the benchmarks and the tests: only their shapes matter.

Unless the config says otherwise: head_dim 64 (vLLM's CPU attention supports only some head sizes:
32, 64, 80, ...) and tied embeddings, as in the small Qwen2 models.
"""
from __future__ import annotations

from pathlib import Path

# name -> (config class, model class) in transformers
ARCHITECTURES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
_DEFAULTS = dict(head_dim=64, tie_word_embeddings=True)

# name -> Qwen2 config fields of the model sizes the sections measure.
QWEN2_SIZES = {
    "qwen2-0.4M": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=512),
    "qwen2-9M": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=32000),
    "qwen2-45M": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=32000),
    "qwen2-120M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=50000),
    "qwen2-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),  # Qwen2-0.5B's shape: 494M parameters
}


def random_model(config: dict, *, arch: str = "qwen2", dtype=None, seed: int = 0):
    """A `arch` causal LM with the config fields `config`, initialised from `seed`, in `dtype`
    (default float32); initialised in that dtype, so a large bf16 model never exists in fp32."""
    import torch
    import transformers

    config_name, model_name = ARCHITECTURES[arch]
    model_config = getattr(transformers, config_name)(**{**_DEFAULTS, **config})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)._from_config(model_config, dtype=dtype or torch.float32)


def save_random_model(directory: Path, config: dict, **kwargs) -> int:
    """`random_model(config, **kwargs)` saved to `directory` with save_pretrained; returns its parameter count."""
    model = random_model(config, **kwargs)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())
