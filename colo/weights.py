"""One copy of the weights for a Hugging Face causal LM and an in-process vLLM engine.

    shared = colo.shared_model(llm)                # a HF model whose parameters are the engine's tensors
    model = shared.hf_model                        # train it with any torch optimizer
    shared.publish()                               # the engine serves the new weights; 0 bytes copied

    shared = colo.share_weights(hf_model, llm)     # or: an existing HF model's values go into the engine
                                                   # once, then its parameters become views of it

The engine's tensors never move: colo.engine.build_llm allocated them in the pool's `weights`
region while vLLM loaded the model, and compiled code captured them there. Every Hugging Face
parameter is a contiguous row range of one engine tensor (fused `qkv_proj` rows q, k, v; fused
`gate_up_proj` rows gate, up; embeddings padded to vLLM's multiple of 64 rows), so the trainer's
`q_proj.weight` is literally rows [0, q) of the engine's `qkv_proj.weight`. An existing model's
parameters keep their identity (`param.data` is re-pointed), so an optimizer built before sharing
keeps working.

When a parameter cannot alias (the trainer's dtype differs from the engine's, or the engine holds a
tensor-parallel shard), the trainer keeps its own tensor and publish() copies it into the engine on
the pool's copy stream, from a plan made once at share time: same-dtype contiguous pieces as one
batch of byte copies (`Stream.copy_async`), casts and strided shards as a few large
`torch._foreach_copy_` buckets. On CPU, where vLLM's GEMM kernels read a packed copy of each linear
weight, publish() also repacks those copies in place from the shared weights (`bytes_repacked`).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import vllm_compat as compat
from .checks import check_int
from .engine import reset_prefix_cache
from .shared import (SUPPORTED_ARCHITECTURES, EngineViews, Placed, PublishReport, check_architecture,  # noqa: F401
                     materialize_buffers, meta_model, no_parameter_for, no_place_for, piece_view, shape_mismatch)
from .regions import WEIGHTS, region_for
from .sizes import shape_bytes

# Config fields that change what the same weights compute; parameter shapes cannot reveal them.
_CONFIG_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                  "rope_parameters", "rope_theta")


@dataclass
class _Source:
    """A validated piece: the HF parameter that feeds it and whether it can alias the engine tensor."""
    tensor: compat.EngineTensor
    piece: compat.Piece
    param: torch.nn.Parameter
    alias: bool


class _Engine(NamedTuple):
    """What share_weights reads of the engine."""
    placement: compat.EnginePlacement | None   # None: an engine colo did not build
    tensors: list[compat.EngineTensor]
    linear_modules: list                       # the modules whose CPU GEMM runs through `cpu_linear`
    device: torch.device


class SharedWeights(EngineViews):
    """The result of `share_weights` / `shared_model`; call `publish()` after each optimizer step.

    aliased_bytes: HF bytes that are views of the engine's tensors (never copied); copy_bytes: bytes
    publish() copies each time (0 when all alias); packed_bytes: CPU weight bytes publish() repacks
    into vLLM's kernel layouts; shared_once_bytes: bytes share_weights copied from the trainer into the
    engine; superseded: a later share_weights on the same engine took the weights over."""

    def __init__(self, hf_model, llm, pool, *, copies: "_CopyPlan", aliased_bytes: int, copy_bytes: int,
                 packed_bytes: int, shared_once_bytes: int, repack):
        super().__init__(llm, hf_model, shared_by="colo.share_weights", repack=repack)
        self.pool = pool
        self.aliased_bytes, self.copy_bytes = aliased_bytes, copy_bytes
        self.packed_bytes, self.shared_once_bytes = packed_bytes, shared_once_bytes
        self.superseded = False
        self._copies = copies  # what publish() copies, planned once
        # Every name, a tied head's too: a checkpoint of the whole model holds both, as state_dict() does.
        self.watch({name: Placed(p, tuple(p.shape)) for name, p in hf_model.named_parameters(remove_duplicate=False)})

    def _check_served(self) -> None:
        if self.superseded:
            raise RuntimeError("a later colo.share_weights on this engine took its weights over; publish with "
                               "the SharedWeights that call returned")

    def _publish_copies(self) -> dict:
        """Orders the training stream before inference, copying or casting the non-aliased parameters
        on the copy stream in between."""
        train, infer = self.pool.stream("train"), self.pool.stream("infer")
        on_cuda = self.pool.device.type == "cuda"
        if on_cuda:  # the optimizer ran on torch's current stream: make it part of the training stream
            train.torch_stream().wait_stream(torch.cuda.current_stream(self.pool.device))
        ready = train.record()
        if self._copies.count:
            ready = self._copies.run(self.pool, after=ready)
        infer.wait(ready)
        if on_cuda:  # vLLM launches on torch's current stream
            torch.cuda.current_stream(self.pool.device).wait_stream(infer.torch_stream())
        else:
            ready.synchronize()  # vLLM runs in this thread on the host
        return dict(bytes_copied=self.copy_bytes, aliased_bytes=self.aliased_bytes, copied_tensors=self._copies.count,
                    buckets=self._copies.batches)


def shared_model(llm, dtype: torch.dtype | None = None, *, bucket_bytes: int = 256 << 20) -> SharedWeights:
    """A Hugging Face model built from the engine's config whose parameters are the engine's own
    tensors: nothing is read from disk and nothing is copied (in the engine's dtype). Its `.hf_model`
    is in training mode, ready for an optimizer.

    dtype: the trainer's dtype (default: the engine's). Parameters in another dtype than the
    engine's cannot alias; they are the engine's values cast once, and publish() casts them back.
    """
    hf_model = meta_model(copy.deepcopy(compat.engine_hf_config(llm)), dtype or compat.engine_dtype(llm))
    return share_weights(hf_model.train(), llm, bucket_bytes=bucket_bytes)


def share_weights(hf_model, llm, pool=None, *, alias: bool = True, bucket_bytes: int = 256 << 20) -> SharedWeights:
    """Make `hf_model` and the in-process engine of `llm` share one copy of the weights.

    hf_model: a transformers causal LM (Llama, Qwen2, Qwen3 families). Its current values are what
        the engine serves from now on: they are written into the engine's tensors once (unless its
        parameters are on the meta device, as in `shared_model`), then its parameters become views.
    llm: a vllm.LLM running in this process, built by colo.engine.build_llm. An eager engine built
        otherwise also works: its weights are first moved into `pool` (default: a new one) and its
        CPU linears run torch.nn.functional.linear; a compiled one is refused (its compiled code
        holds the tensors it would lose).
    alias=False: the trainer keeps its own tensors and publish() copies them (for comparisons).
    bucket_bytes: the size of the copy buckets when parameters cannot alias.

    Sharing an engine again (e.g. with a new model) writes that model's values into the same
    tensors: the earlier SharedWeights can no longer publish, and the earlier model's aliased
    parameters see the new values. Replacing parameter storage after sharing (model.to(...),
    param.data = ...) breaks the link; publish() detects it and raises.

    Raises NotImplementedError for an unsupported architecture and ValueError, naming the first
    mismatching parameter, when the model does not fit the engine; nothing is changed then.
    """
    sources, engine = _validate(hf_model, llm, alias, bucket_bytes)
    pool, repack = _place_engine_weights(llm, engine, pool)
    once = _write_and_alias(hf_model, sources, bucket_bytes, pool)
    copies = [s for s in sources if not s.alias]
    shared = SharedWeights(
        hf_model, llm, pool, copies=_CopyPlan(copies, bucket_bytes),
        aliased_bytes=sum(piece_view(s.tensor, s.piece).nbytes for s in sources if s.alias),
        copy_bytes=sum(piece_view(s.tensor, s.piece).nbytes for s in copies),
        packed_bytes=sum(linear.packed_bytes for linear in repack), shared_once_bytes=once, repack=repack)
    previous = getattr(llm, "colo_shared_weights", None)
    if previous is not None:
        previous.superseded = True
    llm.colo_shared_weights = shared
    if once:
        for linear in repack:
            linear.repack()
    reset_prefix_cache(llm)
    return shared


# --- validating: the Hugging Face model against the engine (no mutation) ---------------------------

def _validate(hf_model, llm, alias: bool, bucket_bytes: int) -> tuple[list[_Source], _Engine]:
    """Everything share_weights checks before it changes anything; returns every engine piece
    matched with its HF parameter, and what it read of the engine."""
    if not isinstance(hf_model, torch.nn.Module):
        raise TypeError(f"hf_model must be a transformers model (torch.nn.Module), not {type(hf_model).__name__}")
    check_architecture(type(hf_model).__name__)
    check_int(bucket_bytes, "bucket_bytes")
    model = compat.engine_model(llm)
    tensors, linear_modules = compat.engine_layout(model)
    placement = compat.engine_placement(llm)
    device = next(t.param.device for t in tensors if t.param.numel())
    sources = _match(hf_model, tensors, alias=alias, device=device)
    _check_config(hf_model, llm, model)
    if placement is None and compat.is_compiled(llm):
        raise RuntimeError("this engine is compiled (torch.compile / CUDA graphs) and was not built by "
                           "colo.engine.build_llm: its compiled code holds weight tensors colo would have to "
                           "replace. Build it with colo.engine.build_llm, or with enforce_eager=True")
    return sources, _Engine(placement, tensors, linear_modules, device)


def _match(hf_model, tensors, alias: bool, device: torch.device) -> list[_Source]:
    """Check every engine piece against the HF model; the first mismatch raises ValueError naming it."""
    by_name = dict(hf_model.named_parameters(remove_duplicate=False))
    used, sources = {}, []
    for t in tensors:
        for piece in t.pieces:
            param = by_name.get(piece.hf_name)
            if param is None:
                raise no_parameter_for(piece.hf_name, t.name, t.shape)
            if id(param) in used:
                raise ValueError(
                    f"{piece.hf_name}: the Hugging Face model ties it to {used[id(param)]}, but the engine keeps "
                    "them separate (tie_word_embeddings differs)")
            if tuple(param.shape) != piece.hf_shape:
                raise shape_mismatch(piece.hf_name, param.shape, piece.hf_shape, t.name)
            if not param.dtype.is_floating_point:
                raise ValueError(f"{piece.hf_name}: dtype {param.dtype} is not a floating-point type")
            if param.is_meta and piece.shard is not None:
                raise NotImplementedError(f"{piece.hf_name}: the engine holds a tensor-parallel shard of it, so a "
                                          "meta-device model cannot be filled from the engine; load the trainer's "
                                          "model from disk and call colo.share_weights")
            used[id(param)] = piece.hf_name
            can_alias = (alias and piece.shard is None and param.dtype == t.dtype
                         and (param.is_meta or param.device == device))
            sources.append(_Source(t, piece, param, can_alias))
    for name, param in by_name.items():
        if id(param) not in used:
            raise no_place_for(name, param.shape)
    return sources


def _check_config(hf_model, llm, model) -> None:
    """Same weights, different meaning: compare the architecture and the fields shapes cannot reveal."""
    arch = type(hf_model).__name__
    if type(model).__name__ != arch:
        raise ValueError(f"architecture: the Hugging Face model is {arch}, the engine serves {type(model).__name__}")
    hf_config, engine_config = hf_model.config, compat.engine_hf_config(llm)
    missing = object()
    for key in _CONFIG_FIELDS:
        mine, theirs = getattr(hf_config, key, missing), getattr(engine_config, key, missing)
        if mine is not missing and theirs is not missing and mine != theirs:
            raise ValueError(f"config.{key}: {mine!r} in the Hugging Face model, {theirs!r} in the engine")


# --- placing the engine's weights in a pool --------------------------------------------------------

def _place_engine_weights(llm, engine: _Engine, pool):
    """(the pool holding the engine's weights, the CpuLinears whose packed copies publish() refreshes).
    An engine colo built has them in its pool already; another one's are moved into `pool` (default:
    a new one on the engine's device)."""
    if engine.placement is not None:
        return engine.placement.pool, [linear for linear in engine.placement.linears if linear.stale_after_update]
    pool = pool if pool is not None else _foreign_engine_pool(llm, engine.device)
    _move_into_pool(pool, engine.tensors, engine.linear_modules)
    return pool, []


def _foreign_engine_pool(llm, device):
    from .pool import Pool

    return Pool(device)


def _move_into_pool(pool, tensors, linear_modules) -> None:
    """An engine colo did not build: move its parameters into the pool's weights region (one copy,
    parameter identity kept) and let its CPU linears read them through F.linear, since their packed
    copies (and, for packed layers, the weights themselves) are gone. Only for eager engines."""
    from .placement import adopt_into

    # 512 bytes a tensor: room for the padding of the region's 256-byte allocation alignment.
    region = region_for(pool, WEIGHTS, sum(shape_bytes(t.shape, t.dtype) + 512 for t in tensors))
    linear_weight_dtypes = {id(m.bias): m.weight.dtype for m in linear_modules if getattr(m, "bias", None) is not None}
    for t in tensors:
        if t.param.numel() == 0 or t.param.dtype != linear_weight_dtypes.get(id(t.param), t.param.dtype):
            # Emptied by a packing kernel (filled from the trainer below), or a bias the sgl kernel
            # made fp32: F.linear wants the weight's dtype.
            dtype = linear_weight_dtypes.get(id(t.param), t.param.dtype)
            old = t.param.detach()
            t.param.data = region.empty(t.shape, dtype)
            if old.numel():
                t.param.data.copy_(old)
            else:
                t.param.data.zero_()
    adopt_into(region, [t.param for t in tensors])
    for module in linear_modules:
        module.cpu_linear = F.linear


# --- writing the trainer's values and aliasing -----------------------------------------------------

def _write_and_alias(hf_model, sources, bucket_bytes: int, pool) -> int:
    """Write the trainer's values into the engine (skipped for meta parameters and for views of the
    engine already), then make aliased parameters views; returns the bytes written."""
    written = 0
    replaced = {}  # id(meta parameter) -> the Parameter that replaces it
    with torch.no_grad():
        for s in sources:
            view = piece_view(s.tensor, s.piece)
            if s.param.is_meta:
                replaced[id(s.param)] = torch.nn.Parameter(
                    view if s.alias else view.to(s.param.dtype, copy=True), requires_grad=s.param.requires_grad)
            elif s.alias and s.param.data_ptr() != view.data_ptr():
                view.copy_(s.param)
                written += view.nbytes
        unwritten = [s for s in sources if not s.alias and not s.param.is_meta]
        if unwritten:
            _CopyPlan(unwritten, bucket_bytes).run(pool).synchronize()
            written += sum(piece_view(s.tensor, s.piece).nbytes for s in unwritten)
    for s in sources:
        if s.alias and not s.param.is_meta:
            s.param.data = piece_view(s.tensor, s.piece)
    if replaced:
        _replace_parameters(hf_model, replaced)
        for s in sources:
            s.param = replaced.get(id(s.param), s.param)
    materialize_buffers(hf_model, sources[0].tensor.param.device)
    return written


def _replace_parameters(module: torch.nn.Module, replaced: dict) -> None:
    """Swap Parameter objects everywhere they are registered (a tied one in two modules)."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and id(param) in replaced:
                sub._parameters[name] = replaced[id(param)]


class _CopyPlan:
    """Copies from trainer tensors into engine pieces, grouped once so that running them is a few
    calls: same-dtype contiguous pairs as one batch of byte copies, the rest (casts, strided
    tensor-parallel shards) as `torch._foreach_copy_` buckets of about `bucket_bytes`."""

    def __init__(self, sources, bucket_bytes: int):
        self.byte_pairs, self.cast_buckets = [], []
        dsts, srcs, size = [], [], 0
        for s in sources:
            dst, src = piece_view(s.tensor, s.piece), s.param.detach()
            if s.piece.shard is not None:
                dim, begin, end = s.piece.shard
                src = src.narrow(dim, begin, end - begin)
            if src.dtype == dst.dtype and src.is_contiguous() and src.device == dst.device:
                self.byte_pairs.append((dst, src))
                continue
            dsts.append(dst)
            srcs.append(src)
            size += dst.nbytes
            if size >= bucket_bytes:
                self.cast_buckets.append((dsts, srcs))
                dsts, srcs, size = [], [], 0
        if dsts:
            self.cast_buckets.append((dsts, srcs))
        self.count = len(self.byte_pairs) + sum(len(d) for d, _ in self.cast_buckets)
        self.batches = int(bool(self.byte_pairs)) + len(self.cast_buckets)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (engine piece, trainer tensor) this plan copies."""
        return self.byte_pairs + [pair for dsts, srcs in self.cast_buckets for pair in zip(dsts, srcs)]

    def run(self, pool, after=None):
        """Enqueue the copies on the pool's copy stream (after event `after`); returns the copy stream's event."""
        copy_stream = pool.stream("copy")
        if after is not None:
            copy_stream.wait(after)
        elif pool.device.type == "cuda":  # the trainer's tensors were written on torch's stream
            copy_stream.torch_stream().wait_stream(torch.cuda.current_stream(pool.device))
        if self.byte_pairs:
            copy_stream.copy_async(self.byte_pairs)
        if self.cast_buckets:
            if pool.device.type != "cuda" and after is not None:
                after.synchronize()  # host: the casts run in this thread, so wait for training's work here
            with _torch_stream(copy_stream):
                for dsts, srcs in self.cast_buckets:
                    torch._foreach_copy_(dsts, srcs)
        return copy_stream.record()


@contextlib.contextmanager
def _torch_stream(stream):
    if stream.pool.device.type == "cuda":
        with torch.cuda.stream(stream.torch_stream()):
            yield
    else:
        yield

