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
    return sum(kv_bytes(1, *_kv_shape(layer), dtype.itemsize, tensor_parallel) for layer in layer_configs(text))


def layer_configs(config) -> list:
    """Each decoder layer's config: the config itself for each, or a heterogeneous one's per-layer views
    (Gemma 4's global layers have a head size of their own, which the config refuses to give globally)."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * config.num_hidden_layers


def _kv_shape(config) -> tuple[int, int]:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def parameter_bytes(hf_config, dtype: torch.dtype) -> int:
    """Bytes of a model's parameters in `dtype`, counted on the meta device (nothing allocated)."""
    import torch

    from .model_classes import trainer_auto_class
    from .vllm_compat.trainer_models import building_trainer_models

    with torch.device("meta"), building_trainer_models():
        model = trainer_auto_class(hf_config).from_config(hf_config)
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


def kv_cache_budget(sequences: int, max_model_len: int, block: int, token_bytes: int, *, memory_fraction: float,
                    device_bytes: int, weight_bytes: int) -> tuple[int, int]:
    """(KV cache bytes, sequences of `max_model_len` tokens they hold) for an engine that generates
    `sequences` at once: all of them at full length where that fits in `memory_fraction` of the
    device's memory less the weights (vLLM's reading of gpu_memory_utilization), else what does
    (vLLM's scheduler then runs fewer sequences at once), and never less than one full-length
    sequence, the least vLLM starts with."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    block_bytes = block * token_bytes
    whole_batch = kv_cache_blocks(sequences, max_model_len, block)
    within_fraction = (int(memory_fraction * device_bytes) - weight_bytes) // block_bytes
    one_sequence = kv_cache_blocks(1, max_model_len, block)
    blocks = max(min(whole_batch, within_fraction), one_sequence)
    return blocks * block_bytes, min(sequences, (blocks - 1) // -(-max_model_len // block))
