"""One copy of the weights for a Hugging Face causal LM and an in-process vLLM engine.

    shared = colo.share_weights(hf_model, llm)     # both models' parameters become views of one store
    ...optimizer.step() on hf_model...
    shared.publish()                               # the engine serves the new weights; 0 bytes copied

The store is one allocation in the pool's `weights` region, laid out in the engine's order: fused
`qkv_proj` (rows q, k, v) and `gate_up_proj` (rows gate, up), embeddings padded to vLLM's multiple of
64 rows. Every Hugging Face parameter is a contiguous row range of one engine tensor, so the trainer's
`q_proj.weight` is literally rows [0, q) of the engine's `qkv_proj.weight`. Parameters keep their
identity (`param.data` is re-pointed), so an optimizer built before sharing keeps working.

When a parameter cannot alias (the trainer's dtype differs from the engine's, or the engine holds a
tensor-parallel shard), the trainer keeps its own tensor and publish() copies it into the store on
the pool's copy stream, from a plan made once at share time: same-dtype contiguous pieces as one
batch of byte copies (`Stream.copy_async`), casts and strided shards as a few large
`torch._foreach_copy_` buckets.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .engine import engine_model, engine_pool, reset_prefix_cache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Config fields that change what the same weights compute; parameter shapes cannot reveal them.
_CONFIG_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                  "rope_parameters", "rope_theta")
_ALIGN_BYTES = 256        # each engine tensor starts on a 256-byte boundary in the store
_REGION_CHUNK = 2 << 20   # region budgets are rounded to the pool's 2 MiB commit chunk
_WEIGHTS_REGION = "weights"


@dataclass
class _Piece:
    """One Hugging Face parameter's place in one engine tensor."""
    hf_name: str
    rows: tuple[int, int]                   # rows [start, stop) of the engine tensor it fills
    hf_shape: tuple[int, ...]               # the full shape the engine expects of the HF parameter
    shard: tuple[int, int, int] | None = None  # (dim, start, stop) of the HF tensor on this rank; None: all


@dataclass
class _EngineTensor:
    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]                  # its real shape (prepacked CPU weights are stored as empty)
    dtype: torch.dtype
    pieces: list[_Piece]
    offset: int = 0                         # element offset in the store of its dtype


@dataclass
class _Source:
    """A validated piece: the HF parameter that feeds it and whether it can alias the store."""
    tensor: _EngineTensor
    piece: _Piece
    param: torch.nn.Parameter
    alias: bool


@dataclass
class SharedWeights:
    """The result of `share_weights`; call `publish()` after each optimizer step."""
    hf_model: torch.nn.Module
    llm: object
    pool: object
    stores: dict                            # dtype -> the store tensor in the `weights` region
    aliased_bytes: int                      # HF bytes that are views of the store (never copied)
    copy_bytes: int                         # bytes publish() copies each time (0 when all alias)
    _copies: "_CopyPlan" = field(repr=False, default=None)        # what publish() copies, planned once
    _watched: list = field(repr=False, default_factory=list)      # [(name, param, data_ptr)]
    _layout: tuple = field(repr=False, default=())                # where each engine tensor sits in the stores
    superseded: bool = False                # a later share_weights on the same engine took the store over
    publish_count: int = 0

    def publish(self) -> dict:
        """Make the engine serve the trainer's current weights.

        Orders the training stream before inference (copying/casting the non-aliased parameters on
        the copy stream in between) and resets vLLM's prefix cache, whose KV was computed with the
        old weights. Returns bytes_copied, seconds, aliased_bytes, copied_tensors, buckets.
        """
        start = time.perf_counter()
        if self.superseded:
            raise RuntimeError("a later colo.share_weights on this engine took its weights over; publish with "
                               "the SharedWeights that call returned")
        self._check_still_shared()
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
        reset_prefix_cache(self.llm)
        self.publish_count += 1
        return {
            "bytes_copied": self.copy_bytes,
            "seconds": time.perf_counter() - start,
            "aliased_bytes": self.aliased_bytes,
            "copied_tensors": self._copies.count,
            "buckets": self._copies.batches,
        }

    def _check_still_shared(self) -> None:
        for name, param, ptr in self._watched:
            if param.data_ptr() != ptr:
                raise RuntimeError(
                    f"{name} was given new storage after share_weights (e.g. model.to(), .half(), or "
                    "assigning param.data); the engine no longer sees it. Call colo.share_weights again."
                )


def check_architecture(arch: str) -> None:
    """Raise NotImplementedError naming `arch` unless colo can share its weights with vLLM."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"colo.share_weights does not support the architecture {arch} (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def share_weights(hf_model, llm, pool=None, *, alias: bool = True, bucket_bytes: int = 256 << 20) -> SharedWeights:
    """Make `hf_model` and the in-process engine of `llm` share one copy of the weights.

    hf_model: a transformers causal LM (Llama, Qwen2, Qwen3 families) whose weights the engine will serve
        (its current values are what the engine serves from now on).
    llm: a vllm.LLM running in this process (see colo.engine.build_llm).
    pool: the colo.Pool whose `weights` region holds the store (default: the engine's pool).
    alias: False keeps every trainer parameter separate and copies in publish() (for comparisons).
    bucket_bytes: the size of the copy buckets when parameters cannot alias.

    Sharing an engine again (e.g. with a new model) refills the store it already uses instead of
    holding two: the earlier SharedWeights can no longer publish, and the earlier model's aliased
    parameters see the new values. Replacing parameter storage after sharing (model.to(...),
    param.data = ...) breaks the link; publish() detects it and raises.

    Raises NotImplementedError for an unsupported architecture and ValueError, naming the first
    mismatching parameter, when the model does not fit the engine; nothing is changed then.
    """
    if not isinstance(hf_model, torch.nn.Module):
        raise TypeError(f"hf_model must be a transformers model (torch.nn.Module), not {type(hf_model).__name__}")
    check_architecture(type(hf_model).__name__)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    model = engine_model(llm)
    engine_dtype = llm.llm_engine.model_config.dtype
    tensors, linears = _engine_layout(model, engine_dtype)
    sources = _match(hf_model, tensors, alias=alias)
    _check_config(hf_model, llm, model)

    # Nothing has changed so far. Allocate and fill the store (new memory only), then re-point.
    pool = pool if pool is not None else engine_pool(llm)
    if pool is None:
        import colo

        pool = colo.Pool(next(model.parameters()).device.type)
    layout = _plan_stores(tensors)
    previous = getattr(llm, "colo_shared_weights", None)
    if previous is not None and previous.pool is pool and previous._layout == layout:
        stores = previous.stores  # the engine's weights memory already: refill it rather than hold two copies
    else:
        stores = _allocate_stores(pool, layout)
    _fill_stores(pool, stores, tensors, sources, bucket_bytes)
    for t in tensors:
        t.param.data = _store_view(stores, t)
    for module in linears:  # prepacked CPU linears keep a private packed copy; read the shared view instead
        module.cpu_linear = F.linear
    for s in sources:
        if s.alias:
            s.param.data = _piece_view(stores, s.tensor, s.piece)

    copies = [s for s in sources if not s.alias]
    shared = SharedWeights(
        hf_model=hf_model, llm=llm, pool=pool, stores=stores,
        aliased_bytes=sum(_nbytes(s.param) for s in sources if s.alias),
        copy_bytes=sum(_piece_view(stores, s.tensor, s.piece).nbytes for s in copies),
        _copies=_CopyPlan(stores, copies, bucket_bytes),
        _watched=[(s.piece.hf_name, s.param, s.param.data_ptr()) for s in sources],
        _layout=layout,
    )
    if previous is not None:
        previous.superseded = True
    llm.colo_shared_weights = shared
    reset_prefix_cache(llm)
    return shared


# --- the engine's layout ---------------------------------------------------------------------------

def _engine_layout(model, engine_dtype):
    """The engine's tensors in order, each with the HF pieces that fill it, and the CPU linears to re-point."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear, LinearBase, ReplicatedLinear, RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    tensors, linears, seen = [], [], set()
    for module_name, module in model.named_modules():
        if hasattr(module, "cpu_linear"):
            linears.append(module)
        for attr, param in module._parameters.items():
            if param is None or id(param) in seen:  # a tied LM head is the embedding's own parameter
                continue
            seen.add(id(param))
            name = f"{module_name}.{attr}" if module_name else attr
            if isinstance(module, LinearBase):
                if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
                    raise NotImplementedError(f"{name}: colo cannot share a {type(module).__name__} yet")
                shape, pieces = _linear_pieces(module, module_name, attr, packed)
                dtype = engine_dtype  # the CPU sgl kernel keeps biases in fp32; F.linear wants one dtype
            elif isinstance(module, VocabParallelEmbedding):
                shape, pieces = _embedding_pieces(module, name)
                dtype = param.dtype
            else:  # norms and other unfused parameters: same name and shape on both sides, replicated
                shape, pieces = tuple(param.shape), [_Piece(name, (0, param.shape[0]) if param.dim() else (0, 1),
                                                            tuple(param.shape))]
                dtype = param.dtype
            if param.numel() and tuple(param.shape) != shape:
                raise RuntimeError(f"colo misread the engine's layout: {name} is {tuple(param.shape)}, expected {shape}")
            tensors.append(_EngineTensor(name, param, shape, dtype, pieces))
    return tensors, linears


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
        pieces.append(_Piece(hf_name, (row, row + size), hf_shape, shard))
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
    return shape, [_Piece(name, (0, rows), hf_shape, shard)]


# --- matching the Hugging Face model against it (no mutation) --------------------------------------

def _match(hf_model, tensors, alias: bool) -> list[_Source]:
    """Check every engine piece against the HF model; the first mismatch raises ValueError naming it."""
    by_name = dict(hf_model.named_parameters(remove_duplicate=False))
    used, sources = {}, []
    for t in tensors:
        for piece in t.pieces:
            param = by_name.get(piece.hf_name)
            if param is None:
                raise ValueError(f"{piece.hf_name}: the engine has {t.name} {t.shape} but the Hugging Face model "
                                 "has no such parameter")
            if id(param) in used:
                raise ValueError(
                    f"{piece.hf_name}: the Hugging Face model ties it to {used[id(param)]}, but the engine keeps "
                    "them separate (tie_word_embeddings differs)")
            if tuple(param.shape) != piece.hf_shape:
                raise ValueError(f"{piece.hf_name}: shape {tuple(param.shape)} in the Hugging Face model, the engine "
                                 f"expects {piece.hf_shape} (for {t.name})")
            if not param.dtype.is_floating_point:
                raise ValueError(f"{piece.hf_name}: dtype {param.dtype} is not a floating-point type")
            used[id(param)] = piece.hf_name
            can_alias = (alias and piece.shard is None and param.dtype == t.dtype
                         and param.device == t.param.device)
            sources.append(_Source(t, piece, param, can_alias))
    for name, param in by_name.items():
        if id(param) not in used:
            raise ValueError(f"{name}: the Hugging Face model has this parameter {tuple(param.shape)} but the engine "
                             "has no place for it (different architecture, layer count or tie_word_embeddings?)")
    return sources


def _check_config(hf_model, llm, model) -> None:
    """Same weights, different meaning: compare the architecture and the fields shapes cannot reveal."""
    arch = type(hf_model).__name__
    if type(model).__name__ != arch:
        raise ValueError(f"architecture: the Hugging Face model is {arch}, the engine serves {type(model).__name__}")
    hf_config, engine_config = hf_model.config, llm.llm_engine.model_config.hf_config
    missing = object()
    for key in _CONFIG_FIELDS:
        mine, theirs = getattr(hf_config, key, missing), getattr(engine_config, key, missing)
        if mine is not missing and theirs is not missing and mine != theirs:
            raise ValueError(f"config.{key}: {mine!r} in the Hugging Face model, {theirs!r} in the engine")


# --- the store ------------------------------------------------------------------------------------

def _plan_stores(tensors) -> tuple:
    """Place each engine tensor at an aligned offset in the store of its dtype (one store in practice)."""
    sizes = {}
    for t in tensors:
        align = _ALIGN_BYTES // _itemsize(t.dtype)
        t.offset = -(-sizes.get(t.dtype, 0) // align) * align
        sizes[t.dtype] = t.offset + _numel(t.shape)
    return tuple(sorted(sizes.items(), key=str)) + tuple((t.name, t.shape, t.dtype, t.offset) for t in tensors)


def _allocate_stores(pool, layout) -> dict:
    sizes = {entry[0]: entry[1] for entry in layout if isinstance(entry[0], torch.dtype)}
    need = sum(-(-n * _itemsize(d) // 4096) * 4096 for d, n in sizes.items())
    if _WEIGHTS_REGION in pool.regions:
        region = pool.regions[_WEIGHTS_REGION]
    else:
        region = pool.region(_WEIGHTS_REGION, budget=max(_REGION_CHUNK, -(-need // _REGION_CHUNK) * _REGION_CHUNK))
    return {dtype: region.empty((n,), dtype=dtype) for dtype, n in sizes.items()}


def _fill_stores(pool, stores, tensors, sources, bucket_bytes) -> None:
    """Write the trainer's current values (and the engine's vocabulary padding rows) into the store."""
    _CopyPlan(stores, sources, bucket_bytes).run(pool).synchronize()
    for t in tensors:  # rows after the last piece are vLLM's vocabulary padding: keep the engine's
        covered = t.pieces[-1].rows[1]
        if not t.shape or covered >= t.shape[0]:
            continue
        padding, old = _store_view(stores, t)[covered:], t.param.detach()
        if tuple(old.shape) == t.shape:
            padding.copy_(old[covered:])
        else:
            padding.zero_()


class _CopyPlan:
    """Copies from trainer tensors into store pieces, grouped once so that running them is a few calls:
    same-dtype contiguous pairs as one batch of byte copies, the rest (casts, strided tensor-parallel
    shards) as `torch._foreach_copy_` buckets of about `bucket_bytes`."""

    def __init__(self, stores, sources, bucket_bytes: int):
        self.byte_pairs, self.cast_buckets = [], []
        dsts, srcs, size = [], [], 0
        for s in sources:
            dst, src = _piece_view(stores, s.tensor, s.piece), s.param.detach()
            if s.piece.shard is not None:
                dim, begin, end = s.piece.shard
                src = src.narrow(dim, begin, end - begin)
            if src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype and src.stride() == dst.stride():
                continue  # already the store itself (the same model shared again)
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

    def run(self, pool, after=None):
        """Enqueue the copies on the pool's copy stream (after event `after`); returns the copy stream's event."""
        copy = pool.stream("copy")
        if after is not None:
            copy.wait(after)
        if self.byte_pairs:
            copy.copy_async(self.byte_pairs)
        if self.cast_buckets:
            if pool.device.type != "cuda" and after is not None:
                after.synchronize()  # host: the casts run in this thread, so wait for training's work here
            with _torch_stream(copy):
                for dsts, srcs in self.cast_buckets:
                    torch._foreach_copy_(dsts, srcs)
        return copy.record()


def _store_view(stores, t: _EngineTensor) -> torch.Tensor:
    return stores[t.dtype][t.offset:t.offset + _numel(t.shape)].view(t.shape)


def _piece_view(stores, t: _EngineTensor, piece: _Piece) -> torch.Tensor:
    view = _store_view(stores, t)
    if not t.shape:
        return view
    return view[piece.rows[0]:piece.rows[1]]


@contextlib.contextmanager
def _torch_stream(stream):
    if stream.pool.device.type == "cuda":
        with torch.cuda.stream(stream.torch_stream()):
            yield
    else:
        yield


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
