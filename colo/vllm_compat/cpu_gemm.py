"""The CPU GEMM kernels (`dispatch_cpu_unquantized_gemm`): vLLM packs each linear weight at load
(sgl-kernel, oneDNN or zentorch) and drops the weight; colo keeps the weight in the region, lets the
kernel keep its packed copy, and refreshes that copy in place at publish (`CpuLinear.repack`).

vLLM's CPU MoE kernel does the same to a MoE layer's experts (`CPUUnquantizedExperts`: w13 and w2 are
replaced by `prepack_moe_weight`'s blocked layout, of the same shape): colo keeps the experts as loaded
(what a trainer's `gate_up_proj` / `down_proj` are views of) and repacks them in place at publish
(`CpuPackedExperts.repack`). On a GPU the fused-MoE kernels read w13 / w2 as loaded: nothing to repack.

So does its causal-conv1d kernel (the linear-attention layers of Qwen3-Next and its kin, on CPUs with
bf16 instructions): the conv weight is replaced by `causal_conv1d_weight_pack`'s layout and the weight
as loaded is stashed as `_cpu_unpacked_conv_weight` (its fallbacks' copy); colo keeps that one as what a
trainer's conv weight views, and repacks it into the served weight at publish (`CpuPackedConv.repack`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..placement import AllocateIn
from .layout import _is_lora_wrapper


# The custom ops vLLM's CPU dispatch packs weights with: op name -> kernel.
_PACKING_OPS = {"convert_weight_packed": "sgl", "create_onednn_mm_handler": "onednn",
                "zentorch_weight_prepack_for_linear": "zentorch"}
_MOE_PACKING_OP = "prepack_moe_weight"   # (weight, out, isa): the experts packed into `out`


class _LoadMode(AllocateIn):
    """AllocateIn that also notes each weight vLLM hands to a packing op, so the weight can be kept
    after vLLM replaces the layer's parameter with an empty one."""

    def __init__(self, region_of, device):
        super().__init__(region_of, device)
        self.packed_from: dict = {}   # id(packed tensor) or oneDNN handle -> (weight it was made from, extra)
        self.experts_packed_from: dict = {}   # address of the packed experts -> (experts as loaded, isa)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs)
        op = getattr(func, "__name__", "").split(".")[0]
        if op == _MOE_PACKING_OP and len(args) >= 3:
            # by address: vLLM registers the packed tensor as a new Parameter object (replace_parameter)
            self.experts_packed_from[args[1].data_ptr()] = (args[0], args[2])
            return result
        kernel = _PACKING_OPS.get(op)
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


@dataclass
class CpuPackedExperts:
    """One MoE layer's expert weights (`w13_weight` or `w2_weight`) that vLLM's CPU MoE kernel serves in a
    packed layout: `weight` is the experts as loaded ([E, 2I, H] or [E, H, I]), kept by colo, what a
    trainer's experts are views of; `repack()` rewrites the served packed tensor from it, in place."""
    module: torch.nn.Module
    attr: str
    weight: torch.Tensor
    isa: str
    used: bool = True

    @property
    def kernel(self) -> str:
        return f"moe-{self.isa}"

    @property
    def packed(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    @property
    def stale_after_update(self) -> bool:
        return True

    @property
    def packed_bytes(self) -> int:
        return self.weight.nbytes

    def repack(self) -> int:
        torch.ops._C.prepack_moe_weight(self.weight, self.packed.detach(), self.isa)
        return self.weight.nbytes


@dataclass
class CpuPackedConv:
    """One causal-conv1d layer whose served weight vLLM's CPU kernel packed at load: `weight` is the
    weight as loaded, shaped as the served one, over vLLM's stashed `_cpu_unpacked_conv_weight` (the
    fallbacks' copy, kept in step), what a trainer's conv weight views; `repack()` rewrites the served
    packed weight from it, in place."""
    module: torch.nn.Module
    weight: torch.Tensor
    used: bool = True

    kernel = "causal-conv1d"
    stale_after_update = True

    @property
    def packed(self) -> torch.Tensor:
        return self.module.weight

    @property
    def packed_bytes(self) -> int:
        return self.weight.nbytes

    def repack(self) -> int:
        unpacked = self.weight.view(self.weight.shape[0], self.weight.shape[-1])
        self.packed.data.copy_(torch.ops._C.causal_conv1d_weight_pack(unpacked).view_as(self.packed))
        return self.weight.nbytes


def _keep_conv_weights(model) -> list[CpuPackedConv]:
    """Every causal-conv1d weight vLLM's CPU kernel packed at load, with the weight as loaded beside it."""
    kept = []
    for module in model.modules():
        unpacked = getattr(module, "_cpu_unpacked_conv_weight", None)
        weight = getattr(module, "weight", None)
        if isinstance(unpacked, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() in (2, 3) \
                and unpacked.numel() == weight.numel():
            kept.append(CpuPackedConv(module, unpacked.view(weight.shape)))
    return kept


def _keep_expert_weights(model, mode: _LoadMode) -> list[CpuPackedExperts]:
    """Every MoE weight vLLM's CPU kernel packed at load, with the experts as loaded kept beside it."""
    kept = []
    for module in model.modules():
        for attr, param in module._parameters.items():
            found = mode.experts_packed_from.get(param.data_ptr()) if param is not None and param.numel() else None
            if found is not None:
                weight, isa = found
                kept.append(CpuPackedExperts(module, attr, weight.detach(), isa))
    return kept


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


def _keep_linear_weights(model, mode: _LoadMode) -> list[CpuLinear]:
    """For every layer vLLM's CPU dispatch handled: which kernel, and the weight it was packed from
    put back as the layer's parameter (vLLM leaves an empty one), so the weight stays in the region."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    linears, seen = [], set()
    lm_head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
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
        # rows up in its weight, so its packed copy is never read, unless the embeddings are tied: then
        # the embedding is the LM head (some models keep no `lm_head` then: Gemma 2 computes its logits
        # from `model.embed_tokens`).
        used = not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead) \
            or module is lm_head or tied
        linear = CpuLinear(module, kernel, used=used, **extra)
        if linear.stale_after_update:
            linear.packed_bytes = module.weight.nbytes
        linears.append(linear)
    return linears


def cpu_linear_modules(model) -> list:
    """The modules whose CPU GEMM vLLM dispatches through `cpu_linear`."""
    return [m for m in model.modules() if not _is_lora_wrapper(m) and hasattr(m, "cpu_linear")]


def restore_emptied_weights(model) -> int:
    """An engine colo did not build: vLLM's packing kernels replaced its linear weights with empty
    Parameters (the packed copy lives in `cpu_linear`). Give each its shape back (zeros, until a trainer
    writes it) so its loader and a trainer can address it; returns how many were restored."""
    from vllm.model_executor.utils import set_weight_attrs

    restored = 0
    for module in cpu_linear_modules(model):
        weight = getattr(module, "weight", None)
        if weight is None or weight.numel():
            continue
        if hasattr(module, "output_size_per_partition"):
            shape, dims = (module.output_size_per_partition, module.input_size_per_partition), {"input_dim": 1}
        else:  # a vocabulary embedding used as the LM head
            shape, dims = (module.num_embeddings_per_partition, module.embedding_dim), {}
        restored_weight = torch.nn.Parameter(torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                                             requires_grad=False)
        # What vLLM's layers set on the weight they create, and their (v1) loaders read.
        set_weight_attrs(restored_weight, {"output_dim": 0, **dims, "weight_loader": module.weight_loader})
        module.weight = restored_weight
        restored += 1
    return restored
