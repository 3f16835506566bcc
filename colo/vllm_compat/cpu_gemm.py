"""The CPU GEMM kernels (`dispatch_cpu_unquantized_gemm`): vLLM packs each linear weight at load
(sgl-kernel, oneDNN or zentorch) and drops the weight; colo keeps the weight in the region, lets the
kernel keep its packed copy, and refreshes that copy in place at publish (`CpuLinear.repack`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..placement import AllocateIn
from .layout import _is_lora_wrapper


# The custom ops vLLM's CPU dispatch packs weights with: op name -> kernel.
_PACKING_OPS = {"convert_weight_packed": "sgl", "create_onednn_mm_handler": "onednn",
                "zentorch_weight_prepack_for_linear": "zentorch"}


class _LoadMode(AllocateIn):
    """AllocateIn that also notes each weight vLLM hands to a packing op, so the weight can be kept
    after vLLM replaces the layer's parameter with an empty one."""

    def __init__(self, region_of, device):
        super().__init__(region_of, device)
        self.packed_from: dict = {}   # id(packed tensor) or oneDNN handle -> (weight it was made from, extra)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs)
        kernel = _PACKING_OPS.get(getattr(func, "__name__", "").split(".")[0])
        if kernel is not None and args and isinstance(args[0], torch.Tensor):
            weight = args[0]
            if kernel == "onednn":  # handed weight.t(): keep the parameter it is a view of
                weight = weight._base if isinstance(weight._base, torch.nn.Parameter) else weight.t()
            key = int(result) if kernel == "onednn" else id(result)
            self.packed_from[key] = (weight, result, args[1:])
        return result


@dataclass
class CpuLinear:
    """One linear (or LM-head embedding) layer of a CPU engine and the kernel vLLM chose for it.

    kernel: "sgl" (sgl-kernel packed weight), "onednn" (a oneDNN handle holding a packed copy),
    "zentorch" (zentorch, packed or not) or "plain" (torch.nn.functional.linear over the weight).
    The layer's `weight` parameter is the canonical copy (in the weights region, what a trainer
    shares); `repack()` rewrites the kernel's packed copy from it, in place.
    """
    module: torch.nn.Module
    kernel: str
    packed: torch.Tensor | None = None      # sgl / prepacked zentorch: the tensor the kernel reads
    handler: object = None                  # oneDNN: vLLM's CPUDNNLGEMMHandler
    cache_size: int = 32                    # oneDNN primitive cache size vLLM asked for
    packed_bytes: int = field(default=0)
    used: bool = True                       # False: vLLM packed it but never calls it (an input embedding)

    @property
    def stale_after_update(self) -> bool:
        """Whether the kernel reads a private copy that must be refreshed when the weight changes."""
        packed = self.kernel in ("sgl", "onednn") or (self.kernel == "zentorch" and self.packed is not None)
        return packed and self.used

    def repack(self) -> int:
        """Refresh the kernel's copy from the layer's weight; returns the bytes of weight repacked."""
        weight = self.module.weight.detach()
        if self.kernel == "sgl":
            self.packed.copy_(torch.ops._C.convert_weight_packed(weight))
        elif self.kernel == "onednn":
            # The handle's address sits in an int64 tensor that compiled code reads at run time.
            fresh = torch.ops._C.create_onednn_mm_handler(weight.t(), self.cache_size)
            old = int(self.handler.handler_tensor.item())
            self.handler.handler_tensor.fill_(fresh)
            torch.ops._C.release_dnnl_matmul_handler(old)
        elif self.kernel == "zentorch" and self.packed is not None:
            self.packed.copy_(torch.ops.zentorch.zentorch_weight_prepack_for_linear(weight))
        else:
            return 0
        return weight.nbytes


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


def _keep_linear_weights(model, mode: _LoadMode) -> list[CpuLinear]:
    """For every layer vLLM's CPU dispatch handled: which kernel, and the weight it was packed from
    put back as the layer's parameter (vLLM leaves an empty one), so the weight stays in the region."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    linears, seen = [], set()
    lm_head = getattr(model, "lm_head", None)
    for name, module in model.named_modules():
        fn = None if _is_lora_wrapper(module) else getattr(module, "cpu_linear", None)
        if fn is None or id(module) in seen:
            continue
        seen.add(id(module))
        cells = _closure(fn)
        if "packed_weight" in cells:
            kernel, key, extra = "sgl", id(cells["packed_weight"]), {"packed": cells["packed_weight"]}
        elif "handler" in cells:
            handler = cells["handler"]
            kernel, key, extra = "onednn", int(handler.handler_tensor.item()), {"handler": handler}
        elif "zen_weight" in cells:
            prepacked = bool((fn.__defaults__ or (False,))[0])
            kernel, key = "zentorch", id(cells["zen_weight"]) if prepacked else None
            extra = {"packed": cells["zen_weight"] if prepacked else None}
            if not prepacked and module.weight.numel() == 0:  # the closure reads the weight's own memory
                module.weight = torch.nn.Parameter(cells["zen_weight"], requires_grad=False)
        elif not cells:
            kernel, key, extra = "plain", None, {}
        else:
            raise NotImplementedError(f"{name}: vLLM chose a CPU GEMM kernel colo does not know (its closure "
                                      f"holds {sorted(cells)}); see colo/vllm_compat/cpu_gemm.py")
        if key is not None:
            if key not in mode.packed_from:
                raise RuntimeError(f"{name}: vLLM packed this layer's weight outside colo's load hook")
            weight, _, args = mode.packed_from[key]
            if module.weight.numel() == 0:
                module.weight = weight if isinstance(weight, torch.nn.Parameter) else \
                    torch.nn.Parameter(weight.detach(), requires_grad=False)
            if kernel == "onednn" and args:
                extra["cache_size"] = int(args[0])
        # vLLM packs every vocabulary embedding for use as an LM head; an input embedding only looks
        # rows up in its weight, so its packed copy is never read (a tied LM head has its own).
        used = not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead) \
            or module is lm_head
        linear = CpuLinear(module, kernel, used=used, **extra)
        if linear.stale_after_update:
            linear.packed_bytes = module.weight.nbytes
        linears.append(linear)
    return linears
