"""The parameter layout: which Hugging Face parameters fill each engine tensor (fused q/k/v and
gate/up, padded vocabulary, tensor-parallel shards), read from vLLM's layer classes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Piece:
    """One Hugging Face parameter's place in one engine tensor."""
    hf_name: str
    rows: tuple[int, int]                   # rows [start, stop) of the engine tensor it fills
    hf_shape: tuple[int, ...]               # the full shape the engine expects of the HF parameter
    shard: tuple[int, int, int] | None = None  # (dim, start, stop) of the HF tensor on this rank; None: all


@dataclass
class EngineTensor:
    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]                  # its real shape
    pieces: list[Piece]

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype


def engine_layout(model) -> tuple[list[EngineTensor], list]:
    """The engine's parameters in order, each with the HF pieces that fill it, and the modules whose
    CPU GEMM is dispatched through `cpu_linear`."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear, LinearBase, ReplicatedLinear, RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    tensors, linears, seen = [], [], set()
    for module_name, module in model.named_modules():
        if _is_lora_wrapper(module):  # its base layer (a submodule) holds the weights
            continue
        if hasattr(module, "cpu_linear"):
            linears.append(module)
        module_name = lora_base_name(module_name)
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen:  # a tied LM head is the embedding's own parameter
                continue
            seen.add(id(param))
            name = f"{module_name}.{attr}" if module_name else attr
            if isinstance(module, LinearBase):
                if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
                    raise NotImplementedError(f"{name}: colo cannot share a {type(module).__name__} yet")
                shape, pieces = _linear_pieces(module, module_name, attr, packed)
            elif isinstance(module, VocabParallelEmbedding):
                shape, pieces = _embedding_pieces(module, name)
            else:  # norms and other unfused parameters: same name and shape on both sides, replicated
                shape = tuple(param.shape)
                pieces = [Piece(name, (0, param.shape[0]) if param.dim() else (0, 1), shape)]
            if param.numel() and tuple(param.shape) != shape:
                raise RuntimeError(f"colo misread the engine's layout: {name} is {tuple(param.shape)}, expected {shape}")
            tensors.append(EngineTensor(name, param, shape, pieces))
    return tensors, linears


def _is_lora_wrapper(module) -> bool:
    # vLLM's LoRA layers (enable_lora=True) wrap the model's layers and forward attribute reads, the
    # kernel's `cpu_linear` included, to `base_layer`; the weights are the base layer's.
    from vllm.lora.layers.base import BaseLayerWithLoRA

    return isinstance(module, BaseLayerWithLoRA)


def lora_base_name(module_name: str) -> str:
    """The layer's name in the model without LoRA: `...qkv_proj.base_layer` -> `...qkv_proj`."""
    return module_name.removesuffix(".base_layer")


def _linear_pieces(module, module_name, attr, packed):
    """The HF parameters behind one (possibly fused, possibly sharded) linear weight or bias."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    rows_total = module.output_size_per_partition
    cols = module.input_size_per_partition
    shape = (rows_total, cols) if attr == "weight" else (rows_total,)
    prefix, _, short = module_name.rpartition(".")
    parts = packed.get(short, [short])
    sizes = list(module.output_partition_sizes)
    if len(parts) != len(sizes):
        raise NotImplementedError(f"{module_name}: {len(sizes)} fused outputs but the mapping names {parts}")
    tp_rank, tp_size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
    pieces, row = [], 0
    for index, (part, size) in enumerate(zip(parts, sizes)):
        hf_name = f"{prefix}.{part}.{attr}" if prefix else f"{part}.{attr}"
        if isinstance(module, ColumnParallelLinear):
            shards, rank = tp_size, tp_rank
            if isinstance(module, QKVParallelLinear) and index > 0:  # k and v heads may be replicated across ranks
                shards, rank = tp_size // module.num_kv_head_replicas, tp_rank // module.num_kv_head_replicas
            hf_shape = (size * shards, cols) if attr == "weight" else (size * shards,)
            shard = (0, rank * size, (rank + 1) * size) if shards > 1 else None
        elif isinstance(module, RowParallelLinear) and attr == "weight":
            hf_shape = (size, cols * tp_size)
            shard = (1, tp_rank * cols, (tp_rank + 1) * cols) if tp_size > 1 else None
        else:  # replicated linear, or the bias of a row-parallel one
            hf_shape, shard = (size, cols) if attr == "weight" else (size,), None
        pieces.append(Piece(hf_name, (row, row + size), hf_shape, shard))
        row += size
    return shape, pieces


def _embedding_pieces(module, name):
    idx = module.shard_indices
    shape = (module.num_embeddings_per_partition, module.embedding_dim)
    if idx.num_added_elements:
        raise NotImplementedError(f"{name}: embeddings with added (LoRA) vocabulary are not supported")
    rows = idx.num_org_elements
    hf_shape = (module.org_vocab_size, module.embedding_dim)
    shard = None if rows == module.org_vocab_size else (0, idx.org_vocab_start_index, idx.org_vocab_end_index)
    return shape, [Piece(name, (0, rows), hf_shape, shard)]
