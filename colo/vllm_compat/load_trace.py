"""Where vLLM puts each element of a Hugging Face model, read from vLLM itself: the engine's own
`load_weights` is run on stand-ins of the trainer's parameters, and every write it makes into an engine
tensor is recorded instead of done.

No list of architectures and no guess of vLLM's names: whatever a model's loader does (fused q/k/v and
gate/up, MoE experts stacked into `w13_weight` / `w2_weight`, renamed prefixes, padded vocabularies,
tensor-parallel narrowing) is seen as it happens. The trainer's parameters enter as meta tensors, so
nothing is allocated whatever the model's size; transformers' own reverse conversion turns them into
the checkpoint names and layout vLLM loads (e.g. a transformers 5 MoE layer's fused `gate_up_proj`
[E, 2I, H] into per-expert `gate_proj` / `up_proj` rows), and a dispatch mode follows each stand-in
through the views and copies vLLM makes of it, so a recorded copy says exactly which elements of which
trainer parameter land on which elements of which engine tensor.

What the loader computes (a sum, a permutation it does not express as a view, a fill) is recorded as
such: those engine tensors are not plain copies of the trainer's and cannot be shared (colo's copy path
loads them through vLLM's `load_weights` instead).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..model_classes import persistent_buffers

aten = torch.ops.aten

# Ops that make a new tensor holding the same elements in the same logical order.
_SAME_ELEMENTS = {aten.clone.default, aten._to_copy.default, aten.lift_fresh.default,
                  aten.lift_fresh_copy.default, aten._unsafe_view.default}


@dataclass(frozen=True)
class Strided:
    """A strided view of a tensor's elements, in elements: what `as_strided(shape, stride, offset)` takes."""
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def whole(shape) -> "Strided":
        return Strided(0, tuple(shape), contiguous_strides(shape))

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This view of a contiguous `tensor`."""
        return tensor.as_strided(self.shape, self.stride, tensor.storage_offset() + self.offset)


@dataclass(frozen=True)
class Write:
    """One write vLLM's loader made into an engine tensor: the elements `dst` of engine tensor `engine`
    received the elements `src` of trainer parameter `source` (both None when the values written are not
    one trainer parameter's elements: a fill, or something the loader computed)."""
    engine: str
    dst: Strided
    checkpoint: str                  # the checkpoint name vLLM was loading
    source: str | None = None
    src: Strided | None = None
    op: str = "copy_"


@dataclass
class LoadTrace:
    writes: list[Write] = field(default_factory=list)
    sources: dict[str, str | None] = field(default_factory=dict)   # checkpoint name -> the trainer parameter it is of

    def copies(self) -> list[Write]:
        return [w for w in self.writes if w.source is not None]

    def computed(self) -> list[Write]:
        """Writes whose values are not a plain copy of trainer elements (fills included)."""
        return [w for w in self.writes if w.source is None]

    def is_fill(self, write: Write) -> bool:
        """A constant written (the padding rows of a vocabulary, of a MoE intermediate size)."""
        return write.op.split(".")[0] in ("fill_", "zero_")


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def checkpoint_tensors(hf_model, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`params` ({the trainer's name: tensor}) in the names and layout a checkpoint of `hf_model` has on
    disk, as transformers writes it (its reverse weight conversion: per-expert MoE weights, original
    prefixes); views of `params` where the conversion makes views."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf_model, dict(params))


def trace_load(engine_model, hf_model, engine_tensors: dict[str, torch.Tensor]) -> LoadTrace:
    """Run `engine_model.load_weights` on meta stand-ins of `hf_model`'s parameters (each distinct
    parameter under its first name) and of its persistent buffers, and record where each element would
    land among `engine_tensors` ({name: tensor}); nothing is written. Raises what vLLM raises for a name
    it has no place for."""
    names: dict[int, str] = {}
    stand_ins: dict[str, torch.Tensor] = {}
    mode = _TraceMode(engine_tensors)
    tensors = [*hf_model.named_parameters(remove_duplicate=False), *persistent_buffers(hf_model).items()]
    for name, tensor in tensors:
        first = names.setdefault(id(tensor), name)
        if first == name:
            stand_ins[name] = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
            mode.track(stand_ins[name], name, Strided.whole(tensor.shape))
    with mode:
        checkpoint = checkpoint_tensors(hf_model, stand_ins)
        try:
            engine_model.load_weights(mode.naming(checkpoint.items()))
        except Exception as e:
            name = mode.checkpoint_name
            source = mode.trace.sources.get(name)
            shape = tuple(checkpoint[name].shape) if name in checkpoint else None
            detail = str(e).split("\n")[0][:300] or type(e).__name__
            raise ValueError(f"{source or name}: the engine has no place for it (vLLM's loader, given it as {name} "
                             f"{shape}, refused: {detail}); a different architecture, layer count, vocabulary "
                             "or tie_word_embeddings?") from e
    return mode.trace


class _TraceMode(TorchDispatchMode):
    """Follows stand-in tensors (meta) through views and copies, and turns every write into a real
    tensor into a recorded `Write` instead of doing it."""

    def __init__(self, engine_tensors: dict[str, torch.Tensor]):
        super().__init__()
        spans = []
        for name, tensor in engine_tensors.items():
            # A strided one is a view vLLM made of another tensor after loading (MLA's W_UV): no load target.
            if tensor.numel() and not tensor.is_meta and tensor.is_contiguous():
                spans.append((tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, name, tensor.element_size()))
        spans.sort()
        self._starts = [s[0] for s in spans]
        self._spans = spans
        self._lineage: dict[int, tuple] = {}     # id(tensor) -> (tensor, (source, Strided)); meta tensors cost nothing
        self._stand_in_storages: dict[int, str] = {}   # storage of an untouched stand-in -> its source
        self._dirty: set[int] = set()                  # storages of stand-ins written in place
        self.trace = LoadTrace()
        self.checkpoint_name = ""

    def track(self, tensor: torch.Tensor, source: str, where: Strided) -> None:
        self._set(tensor, (source, where))
        self._stand_in_storages[_storage_key(tensor)] = source

    def _set(self, tensor: torch.Tensor, lineage) -> None:
        self._lineage[id(tensor)] = (tensor, lineage)

    def naming(self, items):
        """The checkpoint's (name, tensor) pairs, noting which one vLLM is loading while it loads it."""
        for name, tensor in items:
            self.checkpoint_name = name
            origin = self.lineage(tensor)
            self.trace.sources[name] = origin[0] if origin is not None else None
            yield name, tensor

    def lineage(self, tensor: torch.Tensor):
        """(source name, Strided view of it) that `tensor`'s elements are, or None."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return None
        key = _storage_key(tensor)
        if key in self._dirty:
            return None
        found = self._lineage.get(id(tensor))
        if found is not None and found[0] is tensor:
            return found[1]
        source = self._stand_in_storages.get(key)   # a view made outside the mode (e.g. `.data`)
        if source is not None:
            return source, Strided(tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        return None

    def engine_place(self, tensor: torch.Tensor):
        """(engine tensor name, Strided view of it) for a real tensor inside one, else None."""
        if tensor.is_meta or tensor.numel() == 0:
            return None
        ptr = tensor.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        start, end, name, size = self._spans[i]
        if ptr >= end:
            return None
        return name, Strided((ptr - start) // size, tuple(tensor.shape), tuple(tensor.stride()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            return self._copy(args[0], args[1])
        written = _written_arguments(func, args, kwargs)
        for tensor in written:
            if not tensor.is_meta:
                place = self.engine_place(tensor)
                if place is not None:   # a write into an engine tensor that is not a copy: noted, not done
                    self.trace.writes.append(Write(place[0], place[1], self.checkpoint_name, op=func.__name__))
                    return tensor
            else:
                self._dirty.add(_storage_key(tensor))
        if func is aten._to_copy.default and kwargs.get("device") is not None and self.lineage(args[0]) is not None:
            kwargs = {**kwargs, "device": torch.device("meta")}   # a stand-in stays a stand-in
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            return 0    # .item() of a stand-in: a loader that reads values computes what it writes
        out = func(*args, **kwargs)
        first = self.lineage(args[0]) if args else None
        if first is not None:
            if func.is_view:
                self._follow_view(func, args, kwargs, out, first)
            elif func in _SAME_ELEMENTS and isinstance(out, torch.Tensor) and out.shape == args[0].shape:
                self._set(out, first)
        return out

    def _copy(self, dst: torch.Tensor, src):
        origin = self.lineage(src) if isinstance(src, torch.Tensor) else None
        if dst.is_meta:
            if origin is not None and tuple(dst.shape) == tuple(src.shape):
                self._set(dst, origin)
            elif _storage_key(dst) in self._stand_in_storages:
                self._dirty.add(_storage_key(dst))
            return dst
        place = self.engine_place(dst)
        if place is None:
            if isinstance(src, torch.Tensor) and src.is_meta:
                raise RuntimeError("colo's load trace: vLLM copied a stand-in into a tensor outside the engine's "
                                   "parameters; this model's loader cannot be traced")
            return dst.copy_(src)
        if isinstance(src, torch.Tensor) and _broadcast(src.shape, dst.shape) != tuple(dst.shape):
            raise RuntimeError(f"vLLM's loader copies a {tuple(src.shape)} tensor into {place[0]}'s {tuple(dst.shape)}")
        if origin is not None and tuple(src.shape) == tuple(dst.shape):
            self.trace.writes.append(Write(place[0], place[1], self.checkpoint_name, origin[0], origin[1]))
        else:
            self.trace.writes.append(Write(place[0], place[1], self.checkpoint_name, op="copy_ of computed values"))
        return dst

    def _follow_view(self, func, args, kwargs, out, origin) -> None:
        source, where = origin
        base = torch.empty(where.offset + _extent(where), dtype=args[0].dtype, device="meta")
        proxy = base.as_strided(where.shape, where.stride, where.offset)
        try:
            proxy_out = func(proxy, *args[1:], **kwargs)
        except RuntimeError:   # not expressible as a view of the source (e.g. .view() of a strided copy)
            return
        outs, _ = tree_flatten(out)
        proxies, _ = tree_flatten(proxy_out)
        for tensor, p in zip(outs, proxies):
            if isinstance(tensor, torch.Tensor) and isinstance(p, torch.Tensor) and p.dtype == args[0].dtype:
                self._set(tensor, (source, Strided(p.storage_offset(), tuple(p.shape), tuple(p.stride()))))


def _broadcast(a, b):
    try:
        return tuple(torch.broadcast_shapes(tuple(a), tuple(b)))
    except RuntimeError:
        return None


def _extent(where: Strided) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(where.shape, where.stride) if n > 0)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _written_arguments(func, args, kwargs) -> list[torch.Tensor]:
    written = []
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        flat, _ = tree_flatten(value)
        written.extend(t for t in flat if isinstance(t, torch.Tensor))
    return written

