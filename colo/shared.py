"""The contract of a trainer model whose tensors are the engine's.

Three kinds implement it: `colo.weights.SharedWeights` (the whole model, one copy), the tensor-parallel
`colo.tensor_parallel.TensorParallelModel` (this rank's shards) and `colo.lora.SharedAdapter` (an
adapter in the engine's LoRA slot). What they share lives here:

- the parameters are views of engine tensors, watched by address: one given new storage (model.to(),
  .half(), assigning .data) no longer reaches the engine, and publish() refuses rather than serve stale
  weights (`moved_parameters`);
- publish() makes the engine serve what the optimizer wrote: CPU kernels' packed copies are refreshed
  in place, vLLM's prefix cache (KV of the old weights) is forgotten, the publish is counted, and the
  result is a `PublishReport` with the same fields for every kind;
- helpers to build a Hugging Face model on the meta device whose parameters are then pointed at engine
  tensors (`materialize_buffers`).

What differs (what is shared, copying or casting what is not, state dicts, loading) stays with each kind.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class PublishReport(Mapping):
    """What one publish() did. Reads as a dict too (report["bytes_copied"], dict(report)), as before."""
    bytes_copied: int = 0        # bytes copied or cast into the engine (0 when every tensor is a view)
    bytes_repacked: int = 0      # CPU: bytes repacked into vLLM's kernel layouts
    seconds: float = 0.0
    aliased_bytes: int = 0       # trainer bytes that are the engine's (never copied)
    copied_tensors: int = 0
    buckets: int = 0             # copy batches on the copy stream
    adapter_bytes: int = 0       # LoRA: the adapter's bytes in the engine's slot

    def __getitem__(self, key: str):
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class EngineViews:
    """Base of the kinds above. Subclasses set `llm`, call `watch(named parameters)` once their
    parameters are views, list in `_repack` the CPU linears whose packed copies go stale, and end
    publish() with `finish_publish(started, ...)`."""

    llm: object
    publish_count: int = 0
    _watched: list          # [(name, parameter, data_ptr)]
    _repack: list           # colo.vllm_compat.CpuLinear whose packed copy the trainer's updates make stale

    def watch(self, named_parameters) -> None:
        self._watched = [(name, p, p.data_ptr()) for name, p in named_parameters]

    def moved_parameters(self) -> list[str]:
        """Names of the parameters given new storage since they were shared: the engine no longer sees them."""
        return [name for name, p, ptr in self._watched if p.data_ptr() != ptr]

    def check_not_moved(self, shared_by: str) -> None:
        moved = self.moved_parameters()
        if moved:
            raise RuntimeError(f"{moved[0]} was given new storage after {shared_by} (e.g. model.to(), .half(), or "
                               f"assigning param.data); the engine no longer sees it. Call {shared_by} again.")

    def finish_publish(self, started: float, **report) -> PublishReport:
        """The end of every publish(): packed CPU copies refreshed, stale prefixes forgotten, counted."""
        from .engine import reset_prefix_cache

        repacked = sum(linear.repack() for linear in getattr(self, "_repack", ()))
        reset_prefix_cache(self.llm)
        self.publish_count += 1
        return PublishReport(bytes_repacked=repacked, seconds=time.perf_counter() - started, **report)


def materialize_buffers(hf_model, device) -> None:
    """A meta-device model's buffers (rotary frequencies) computed for real, as transformers does when
    it loads a checkpoint onto the meta device."""
    for module in hf_model.modules():
        meta = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            raise NotImplementedError(f"{type(module).__name__} has buffers colo cannot compute on the meta device "
                                      f"({meta}); load the trainer's model from disk and call colo.share_weights")
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        hf_model._init_weights(module)
