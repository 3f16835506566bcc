"""How much memory an engine's KV cache and weights take, from a model's shape: one place for the
scheduler (colo.grpo.rollout_engine), colo.trl and the planner (colo.plan). No torch import at load:
the planner is arithmetic."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: no torch import at load
    import torch


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """K and V of one token over all layers on one tensor-parallel rank: vLLM gives each rank
    kv_heads / tp heads, or one (replicated) when there are fewer KV heads than ranks."""
    return 2 * layers * max(1, kv_heads // tensor_parallel) * head_dim * dtype_bytes


def kv_bytes_per_token(hf_config, dtype: torch.dtype, tensor_parallel: int = 1) -> int:
    """Bytes of K and V one token occupies over all layers, on one of `tensor_parallel` ranks (each
    holds its share of the KV heads, at least one: vLLM replicates a head over several ranks)."""
    text = getattr(hf_config, "text_config", hf_config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return kv_bytes(text.num_hidden_layers, heads, head_dim, dtype.itemsize, tensor_parallel)


def parameter_bytes(hf_config, dtype: torch.dtype) -> int:
    """Bytes of a model's parameters in `dtype`, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def default_block_size(device) -> int:
    """vLLM's own default KV block size: 128 tokens on CPU (its CPU attention kernels prefer it), 16 on CUDA.
    Passed explicitly so the KV budget can be counted in whole blocks."""
    return 128 if device.type == "cpu" else 16


def kv_cache_blocks(sequences: int, sequence_tokens: int, block: int) -> int:
    """KV blocks for `sequences` sequences of `sequence_tokens` tokens held at once: whole blocks per
    sequence, plus the one block vLLM keeps as its null block (v1/core/block_pool.py), which no
    sequence can use. One short, a sequence is preempted and recomputed every batch."""
    return sequences * -(-sequence_tokens // block) + 1
