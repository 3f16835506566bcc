"""LoRA: the engine's adapter slots (`lora_a_stacked`/`lora_b_stacked`) the trainer's adapter is a view
of, a one-adapter fast path for vLLM's CPU punica wrapper (a subclass, swapped in on the engine's
wrappers), and the adapter a request that names none is served with.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .engine_access import engine_model, engine_worker, request_hooks
from .layout import _is_lora_wrapper


# vLLM pads every adapter to `max_lora_rank`, which must be one of these (vllm/config/lora.py, MaxLoRARanks).
LORA_SLOT_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_options(rank: int) -> dict:
    """vllm.LLM options for one trainable adapter of `rank`: one slot (`max_loras=1`), slots padded to
    the smallest rank vLLM allows that holds it, in the model's dtype (`lora_dtype="auto"`)."""
    if not 1 <= rank <= LORA_SLOT_RANKS[-1]:
        raise ValueError(f"LoRA rank must be in [1, {LORA_SLOT_RANKS[-1]}] (vLLM's largest max_lora_rank), got {rank}")
    return dict(enable_lora=True, max_loras=1, max_cpu_loras=1,
                max_lora_rank=next(r for r in LORA_SLOT_RANKS if r >= rank))


@dataclass
class AdapterSlice:
    """One linear layer's place in the engine's adapter slot; `module` is the layer's name in the engine
    (after vLLM's renaming of the Hugging Face name, engine_module_names).

    A is lora_a_stacked[slice][slot, 0, :rank, :] (rank x in) and B is lora_b_stacked[slice][slot, 0, :, :rank]
    (out x rank): vLLM's layers compute `out += (x @ A.T) @ B.T` (PunicaWrapper.add_lora_linear with
    scale 1.0), with the adapter's alpha/rank already multiplied into B when the adapter was set
    (LoRALayerWeights.optimize). Fused layers (q/k/v, gate/up) have one A and one B per sub-projection.

    With tensor parallelism (vLLM's default LoRA, not fully sharded) each rank's slot holds a part:
    `split` "B" for column-parallel layers (q/k/v, gate/up: this rank's output rows of B, those of its
    base weight's shard, and the whole A; ColumnParallelLinearWithLoRA.slice_lora_b), "A" for
    row-parallel ones (o_proj, down_proj: this rank's input columns of A and the whole B;
    RowParallelLinearWithLoRA.slice_lora_a; the layer adds B (A_r x_r) to its partial output before
    its all-reduce). None: one rank, the whole adapter.
    """
    module: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    split: str | None = None


def activate_adapter(llm, lora_request) -> int:
    """Load `lora_request` into the engine's slot once and pin it there (an LRU cache would otherwise be
    free to evict it and, on its next use, copy the adapter from disk over what the trainer wrote).
    Returns the slot index."""
    if not has_lora_slots(llm):
        raise RuntimeError("this engine was built without enable_lora=True; it has no adapter slots")
    check_shareable_lora(llm.llm_engine.vllm_config.lora_config.fully_sharded_loras,
                         llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    llm.llm_engine.add_lora(lora_request)
    llm.llm_engine.pin_lora(lora_request.lora_int_id)
    one_adapter_fast_path(llm)
    return adapter_slot(llm, lora_request.lora_int_id)


def check_shareable_lora(fully_sharded_loras: bool, tensor_parallel_size: int) -> None:
    """Refuse vLLM's fully sharded LoRA (S-LoRA) on a tensor-parallel engine: its slots hold a rank
    slice of A (column-parallel layers) or B (row-parallel ones), and its shrink results are gathered
    or all-reduced between A and B, which colo's trainer does not model."""
    if fully_sharded_loras and tensor_parallel_size > 1:
        raise NotImplementedError("fully_sharded_loras=True with tensor parallelism: colo shares vLLM's default "
                                  "tensor-parallel LoRA slots only (B split for column-parallel layers, A for "
                                  "row-parallel ones); build the engine without fully_sharded_loras")


def has_lora_slots(llm) -> bool:
    """Whether the engine was built with enable_lora=True (it has adapter slots)."""
    return bool(llm.llm_engine.vllm_config.lora_config)


def one_adapter_fast_path(llm) -> None:
    """On CPU, give the engine's punica wrappers the one-adapter fast path below. vLLM's CPU wrapper
    (`PunicaWrapperCPU`, the torch ops in lora/ops/torch_ops) gathers a copy of A and B per token at
    every LoRA layer and multiplies them with einsum: at 0.36B parameters that doubled a generate
    (profiled: bmm, index and copy took 2 of 3.9 s). The subclass changes no state, only the methods;
    wrappers of other platforms (the GPU's Triton kernels) are left as they are."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    for wrapper in punica_wrappers(llm):
        if type(wrapper) is PunicaWrapperCPU:
            wrapper.__class__ = _one_adapter_punica_cpu()
            wrapper.batch_slot = None


def punica_wrappers(llm) -> list:
    """The engine's punica wrappers (one per model part; each LoRA layer holds its part's wrapper)."""
    return list(_adapter_manager(llm).punica_wrapper_mapping.values())


def _adapter_manager(llm):
    """vLLM's LoRA model manager of this engine (its slots, packing and punica wrappers)."""
    return engine_worker(llm).model_runner.lora_manager._adapter_manager


@functools.cache
def _one_adapter_punica_cpu():
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    class OneAdapterPunicaCPU(PunicaWrapperCPU):
        """When every token of a batch uses the same slot (colo serves one adapter, by default), a LoRA
        layer is two small matmuls on the slot's A and B: `buffer = scale * (x @ A.T)` in fp32 and
        `y[:, slice] += buffer @ B.T` in y's dtype, the arithmetic of vLLM's torch ops without the
        per-token gathers. Any other batch (no adapter, mixed slots) takes vLLM's own path."""

        def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
            super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
            indices = self.token_lora_indices
            first = int(indices[0]) if indices.numel() else -1
            # the batch's one slot, -1 for a batch of no adapter, None for mixed slots
            self.batch_slot = first if bool((indices == first).all()) else None

        @property
        def single_slot(self) -> int | None:
            """The slot every token of the batch uses, None where they use several or none."""
            return self.batch_slot if self.batch_slot != -1 else None

        def _one_slot(self, x: torch.Tensor) -> int | None:
            slot = self.single_slot
            return slot if slot is not None and x.shape[0] == self.token_lora_indices.shape[0] else None

        def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
            x = x.view(-1, x.shape[-1])
            slot = self._one_slot(x)
            if slot is None:
                return super().add_shrink(y, x, lora_a_stacked, scale, **kwargs)
            for out, a in zip(y, lora_a_stacked):
                out = out.view(-1, out.shape[-1])
                torch.mm(x.to(out.dtype), a[slot, 0].to(out.dtype).t(), out=out)
                out.mul_(scale)

        def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
            # vLLM's path indexes A and B by `sampler_indices` (one per sampled token) and fails on
            # prompt logprobs' hidden states (one per prompt token) of a model whose LM head has an
            # adapter slot (LLaVA's, Qwen3-VL's); with one slot (or none) for the whole batch, every row
            # takes that slot
            slot = self.batch_slot
            if slot is None:
                return super().add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)
            if slot < 0:
                return
            flat, x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
            shrunk = scale * (x.float() @ lora_a_stacked[slot, 0].float().t())
            update = shrunk.to(flat.dtype) @ lora_b_stacked[slot, 0].to(flat.dtype).t()
            width = min(update.shape[1], flat.shape[1])   # the adapter and the model may pad the vocabulary apart
            flat[:, :width].add_(update[:, :width])

        def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
            flat = y.view(-1, y.shape[-1])
            slot = self._one_slot(flat)
            if slot is None:
                return super().add_expand(y, x, lora_b_stacked, output_slices, offset_start, add_inputs, **kwargs)
            offset = offset_start
            for buffer, b, size in zip(x, lora_b_stacked, output_slices):
                out = flat[:, offset:offset + size]
                update = buffer.to(flat.dtype) @ b[slot, 0].to(flat.dtype).t()
                out.add_(update) if add_inputs else out.copy_(update)
                offset += size

    return OneAdapterPunicaCPU


def adapter_slot(llm, lora_id: int) -> int | None:
    """The slot that serves adapter `lora_id` now, or None if it is not active."""
    slots = _adapter_manager(llm).lora_index_to_id
    return slots.index(lora_id) if lora_id in slots else None


def adapter_slices(llm, slot: int, rank: int) -> list[AdapterSlice]:
    """Views of slot `slot` of every LoRA layer of the engine, one per Hugging Face linear layer (with
    tensor parallelism: this rank's parts, `AdapterSlice.split`)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    # {fused layer's full name: its parts' full names}, what vLLM's LoRA manager packs an adapter's
    # layers by (a model class's own packed_modules_mapping can be empty, Qwen2-VL's: vLLM then takes
    # its submodules')
    packed = _adapter_manager(llm).packed_modules
    slices = []
    for name, module in engine_model(llm).named_modules():
        if not _is_lora_wrapper(module):
            continue
        if not isinstance(module, BaseLinearLayerWithLoRA):
            continue  # an embedding's or LM head's slot (some families have one): colo leaves it at zero
        split = _tensor_parallel_split(name, module)
        parts = packed.get(name, [name]) if module.n_slices > 1 else [name]
        if len(parts) != module.n_slices:
            raise NotImplementedError(f"{name}: {module.n_slices} fused adapter slices but vLLM's LoRA manager "
                                      f"packs {parts} into it")
        for part, a, b in zip(parts, module.lora_a_stacked, module.lora_b_stacked):
            slices.append(AdapterSlice(part, a[slot, 0, :rank, :], b[slot, 0, :, :rank], split))
    return slices


def engine_module_names(llm, hf_modules) -> dict[str, str]:
    """{Hugging Face module name: the engine's name of it}, renamed as vLLM renames a PEFT adapter's
    module names when it loads one (LoRAModel.from_local_checkpoint with the model's
    `hf_to_vllm_mapper`, renames only: a vision-language model's `model.language_model.layers.0...`
    is vLLM's `language_model.model.layers.0...` in Qwen2.5-VL)."""
    mapper = getattr(engine_model(llm), "hf_to_vllm_mapper", None)
    if mapper is None:
        return {name: name for name in hf_modules}
    mapper = mapper.get_rename_mapper()
    return {name: mapper._map_name(name) or name for name in hf_modules}


def _tensor_parallel_split(name: str, module) -> str | None:
    """Which of A ("A") or B ("B") this tensor-parallel rank's slot holds a part of (AdapterSlice.split);
    NotImplementedError for layers whose LoRA arithmetic differs from the plain split."""
    from vllm.lora.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA

    if module.tp_size == 1:
        return None
    check_shareable_lora(module.lora_config.fully_sharded_loras, module.tp_size)
    base = module.base_layer
    if isinstance(module, ColumnParallelLinearWithLoRA) and not base.gather_output:
        return "B"
    if isinstance(module, RowParallelLinearWithLoRA) and base.input_is_parallel and base.reduce_results:
        return "A"
    raise NotImplementedError(f"{name}: colo shares tensor-parallel adapters of column-parallel layers (without "
                              f"gather_output) and row-parallel layers (parallel input, reduced output) only, not "
                              f"of a {type(module).__name__}")


def serve_adapter_by_default(llm, lora_request) -> None:
    """Requests to `llm` that name no adapter get `lora_request` (the trained model is base + adapter:
    TRL, a user's `llm.generate` or an eval callback then all see it). A rule of the engine's
    RequestHooks, beside any request_guard check, in either order."""
    request_hooks(llm).default_lora_request = lora_request
