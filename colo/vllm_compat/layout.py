"""The parameter layout: where each Hugging Face parameter lives among the engine's tensors, read from
vLLM's own loader (colo.vllm_compat.load_trace), for any model family vLLM and transformers both have.

    layout = engine_layout(engine_model, hf_model)
    layout.placements["model.layers.0.self_attn.k_proj.weight"].view   # (engine tensor, Strided) or None

A parameter whose elements vLLM's loader copies into one engine tensor in a layout a strided view can
express (a row range of a fused `qkv_proj`, a MoE layer's `gate_up_proj` [E, 2I, H] as all of
`w13_weight`, this rank's shard of a tensor-parallel layer) is that view: the trainer's parameter can be
the engine's tensor. Anything else (a gap the CPU MoE kernel pads between gate and up rows, values the
loader computes) still has `pieces`, each a plain strided copy, or is loaded through vLLM's
`load_weights` (`through_loader`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .load_trace import Strided, Write, contiguous_strides, persistent_buffers, trace_load


@dataclass(frozen=True)
class Piece:
    """Elements `part` of a Hugging Face parameter, at elements `view` of engine tensor `engine`."""
    engine: str
    view: Strided
    part: Strided


@dataclass
class Placement:
    """Where one Hugging Face parameter lives in the engine.

    view: (engine tensor name, Strided) holding what this rank has of it as one view, else None;
    covered: None when the engine holds all of it, else (dim, segments): this tensor-parallel rank holds
    the (start, stop) segments along `dim`, one after another (the view's shape is theirs);
    through_loader: the engine's values are computed from it by vLLM's loader (not a copy);
    unserved: vLLM's loader takes it and keeps none of it (a vision tower's layers past the one the
    model reads its image features from, which vLLM does not build)."""
    hf_name: str
    hf_shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    view: tuple[str, Strided] | None = None
    covered: tuple[int, tuple[tuple[int, int], ...]] | None = None
    through_loader: bool = False
    checkpoint_names: tuple[str, ...] = ()
    unserved: bool = False


@dataclass
class EngineTensor:
    """One engine tensor: `param` is what a trainer's view reads (for a CPU kernel that repacks its
    weights, the unpacked tensor colo keeps), `served` the tensor vLLM computes with."""
    name: str
    param: torch.Tensor
    served: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype


@dataclass
class EngineLayout:
    tensors: dict[str, EngineTensor]
    placements: dict[str, Placement]
    unfilled: list[str]          # engine tensors no trainer parameter fills (vLLM's own state)


def engine_layout(model, hf_model, kept: dict | None = None) -> EngineLayout:
    """Read the layout of engine `model` (vLLM's torch module) for the Hugging Face model `hf_model` (any
    device, meta included: only names, shapes and dtypes are read). kept: {id(served tensor): the tensor
    colo kept unpacked} for CPU kernels that repack weights (colo.vllm_compat.cpu_gemm)."""
    kept = kept or {}
    tensors = {}
    for name, param in model.named_parameters():
        name = lora_base_name_of_param(name)
        tensors[name] = EngineTensor(name, kept.get(id(param), param), param)
    # Buffers the loader fills are weights too (Gemma 4's per-layer `layer_scalar`, xIELU's `beta`):
    # load targets beside the parameters; the others are vLLM's own state (rotary tables).
    buffers = {name: buffer for name, buffer in model.named_buffers() if name not in tensors}
    trace = trace_load(model, hf_model, {**{name: t.served for name, t in tensors.items()}, **buffers})
    parameters = list(tensors)
    for name in sorted({w.engine for w in trace.writes} & set(buffers)):
        tensors[name] = EngineTensor(name, buffers[name], buffers[name])
    shapes = {name: tuple(t.shape) for name, t in [*hf_model.named_parameters(), *persistent_buffers(hf_model).items()]}
    placements: dict[str, Placement] = {}

    def placement_of(source: str) -> Placement:
        return placements.setdefault(source, Placement(source, shapes[source]))

    for write in trace.copies():
        placement = placement_of(write.source)
        placement.pieces.append(Piece(write.engine, write.dst, write.src))
    # Values the loader computed (not a constant in padding): their parameter goes through the loader.
    fills: dict[str, list[Write]] = {}
    for write in trace.computed():
        if trace.is_fill(write):
            fills.setdefault(write.engine, []).append(write)
            continue
        source = trace.sources.get(write.checkpoint)
        if source is None:
            raise NotImplementedError(f"{write.engine}: vLLM's loader computes it from {write.checkpoint}, which colo "
                                      "cannot follow back to one parameter of the trainer's model")
        placement_of(source).through_loader = True
    for source in {s for s in trace.sources.values() if s is not None} - set(placements):
        placements[source] = Placement(source, shapes[source], unserved=True)
    for checkpoint, source in trace.sources.items():
        if source in placements:
            placements[source].checkpoint_names += (checkpoint,)
    for placement in placements.values():
        if any(_overlaps(piece, fills.get(piece.engine, ())) for piece in placement.pieces):
            placement.through_loader = True
        if placement.through_loader or placement.unserved:
            continue
        solved = solve_view(placement.pieces, placement.hf_shape)
        if solved is not None:
            engine, view, covered = solved
            placement.view, placement.covered = (engine, view), covered
    written = {w.engine for w in trace.writes}
    # An engine tensor in the storage of one the loader fills is a view of it that vLLM made after loading
    # (MLA's W_UV and W_UK_T, taken from kv_b_proj's weight): it follows that tensor, filled with it.
    filled_storages = {tensors[name].served.untyped_storage().data_ptr() for name in written}
    unfilled = [name for name in parameters if name not in written and tensors[name].served.numel()
                and tensors[name].served.untyped_storage().data_ptr() not in filled_storages]
    return EngineLayout(tensors, placements, unfilled)


def solve_view(pieces: list[Piece], hf_shape) -> tuple[str, Strided, tuple | None] | None:
    """The one strided view of one engine tensor that the pieces of a parameter make together, and the
    part of the parameter it holds: None (all of it), else (dim, segments): along `dim`, the (start, stop)
    segments it holds, one after another (a tensor-parallel rank's rows of a fused MoE `gate_up_proj` are
    its gate rows then its up rows); the view's shape is that part's. None where the pieces do not make
    one view (several engine tensors, gaps, overlaps, a layout no view expresses)."""
    if not pieces or len({p.engine for p in pieces}) != 1:
        return None
    boxes = [_box(p.part, hf_shape) for p in pieces]
    if any(b is None for b in boxes):
        return None
    rank = len(hf_shape)
    covered = [_merged([(b[0][d], b[0][d] + b[1][d]) for b in boxes]) for d in range(rank)]
    sizes = [sum(stop - start for start, stop in segments) for segments in covered]
    if sum(math.prod(b[1]) for b in boxes) != math.prod(sizes) or _any_overlap(boxes):
        return None   # the pieces do not tile the product of what they cover
    partial = [d for d in range(rank) if covered[d] != [(0, hf_shape[d])]]
    if len(partial) > 1:
        return None
    local_boxes = [_localized(b, covered) for b in boxes]
    view = _one_view(pieces, local_boxes, sizes)
    if view is None:
        return None
    return pieces[0].engine, view, (partial[0], tuple(covered[partial[0]])) if partial else None


def _merged(intervals) -> list[tuple[int, int]]:
    merged = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _localized(box, covered):
    """A box of the parameter in the coordinates of the part held (segments put one after another)."""
    start, size, dims = box
    local = []
    for d, x in enumerate(start):
        offset = 0
        for seg_start, seg_stop in covered[d]:
            if seg_start <= x < seg_stop:
                local.append(offset + x - seg_start)
                break
            offset += seg_stop - seg_start
    return local, size, dims


def _one_view(pieces: list[Piece], boxes, shape) -> Strided | None:
    """The strided view of the engine tensor whose elements are the pieces laid out as `boxes` in a
    tensor of `shape`, or None. Engine offset of element x: base + sum_d x_d * stride_d, one unknown
    stride per dimension: each piece gives its own strides and where its first element is."""
    rank = len(shape)
    stride: list[int | None] = [None] * rank
    for piece, (start, size, dims) in zip(pieces, boxes):
        for k, d in dims.items():
            if stride[d] is not None and stride[d] != piece.view.stride[k]:
                return None
            stride[d] = piece.view.stride[k]
    first = min(range(len(pieces)), key=lambda i: pieces[i].view.offset)
    for d in range(rank):
        if stride[d] is None:   # a dimension no piece runs along (one expert per piece): from the offsets
            others = [(boxes[i][0][d] - boxes[first][0][d], pieces[i].view.offset - pieces[first].view.offset)
                      for i in range(len(pieces)) if boxes[i][0][d] != boxes[first][0][d]]
            stride[d] = others[0][1] // others[0][0] if others else contiguous_strides(shape)[d]
    base = pieces[first].view.offset - sum(boxes[first][0][d] * stride[d] for d in range(rank))
    for piece, (start, size, dims) in zip(pieces, boxes):
        if piece.view.offset != base + sum(start[d] * stride[d] for d in range(rank)):
            return None
    return Strided(base, tuple(shape), tuple(stride)) if base >= 0 else None


def _box(part: Strided, shape) -> tuple[list[int], list[int], dict[int, int]] | None:
    """A part of a contiguous tensor of `shape` as a box: (first index, sizes per dimension, {dimension of
    the part: dimension of the tensor}), or None where the part is not a box of unit steps."""
    strides = contiguous_strides(shape)
    start, rest = [], part.offset
    for s in strides:
        start.append(rest // s)
        rest %= s
    size = [1] * len(shape)
    dims = {}
    for k, (n, s) in enumerate(zip(part.shape, part.stride)):
        if n == 1:
            continue
        candidates = [d for d in range(len(shape)) if strides[d] == s and shape[d] > 1 and d not in dims.values()]
        if not candidates:
            return None
        d = candidates[0]
        dims[k] = d
        size[d] = n
    if any(start[d] + size[d] > shape[d] for d in range(len(shape))):
        return None
    return start, size, dims


def _any_overlap(boxes) -> bool:
    ranges = sorted((tuple(b[0]), tuple(b[0][d] + b[1][d] for d in range(len(b[0])))) for b in boxes)
    for i, (lo_a, hi_a) in enumerate(ranges):
        for lo_b, hi_b in ranges[i + 1:]:
            if all(max(x, y) < min(u, v) for x, y, u, v in zip(lo_a, lo_b, hi_a, hi_b)):
                return True
    return False


def _span(view: Strided) -> tuple[int, int]:
    return view.offset, view.offset + sum((n - 1) * s for n, s in zip(view.shape, view.stride) if n) + 1


def _overlaps(piece: Piece, writes) -> bool:
    lo, hi = _span(piece.view)
    return any(max(lo, a) < min(hi, b) for a, b in (_span(w.dst) for w in writes))


def lm_head_names(model) -> set[str]:
    """The engine tensors that are LM heads (vLLM's ParallelLMHead weights), by their layout names."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return {lora_base_name_of_param(f"{name}.weight") for name, module in model.named_modules()
            if isinstance(module, ParallelLMHead)}


def lora_base_name_of_param(name: str) -> str:
    """An engine parameter's name without vLLM's LoRA wrapper: `...qkv_proj.base_layer.weight` ->
    `...qkv_proj.weight`."""
    return name.replace(".base_layer.", ".")


def _is_lora_wrapper(module) -> bool:
    # vLLM's LoRA layers (enable_lora=True) wrap the model's layers and forward attribute reads, the
    # kernel's `cpu_linear` included, to `base_layer`; the weights are the base layer's.
    from vllm.lora.layers.base import BaseLayerWithLoRA

    return isinstance(module, BaseLayerWithLoRA)


def lora_base_name(module_name: str) -> str:
    """The layer's name in the model without LoRA: `...qkv_proj.base_layer` -> `...qkv_proj`."""
    return module_name.removesuffix(".base_layer")
