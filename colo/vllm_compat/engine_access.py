"""The engine: model access (its worker, model, KV cache, dtype, config, groups) and its lifecycle
(start-up memory, the hooks run before every request and step, teardown).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import weakref

import torch

from .version import import_vllm
from .worker import EnginePlacement


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


def image_attention_is_causal(llm) -> bool:
    """Whether the engine attends causally among an image's tokens where the model attends both ways
    (a prefix-LM's images, vLLM's `is_mm_prefix_lm`: Gemma 3, PaliGemma): vLLM attends both ways only in
    attention backends that say `supports_mm_prefix` (its GPU ones); its CPU backend (0.32) is causal."""
    if not llm.llm_engine.model_config.is_mm_prefix_lm:
        return False
    # The decoder's attention layers hold their backend's class (a vision tower's, an enum of its own kind).
    backends = {m.attn_backend for m in engine_model(llm).modules() if isinstance(getattr(m, "attn_backend", None), type)}
    return not backends or not all(backend.supports_mm_prefix() for backend in backends)


def engine_dtype(llm) -> torch.dtype:
    return llm.llm_engine.model_config.dtype


def engine_tokenizer(llm):
    """The engine's tokenizer: vLLM's own, or, for an engine started without one (skip_tokenizer_init),
    transformers' from the directory or hub name vLLM would have loaded it from; None where there is none."""
    if not llm.llm_engine.model_config.skip_tokenizer_init:
        return llm.get_tokenizer()
    from transformers import AutoTokenizer

    config = llm.llm_engine.model_config
    try:
        return AutoTokenizer.from_pretrained(config.tokenizer, revision=config.tokenizer_revision,
                                             trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError, KeyError):   # a model saved without one (tiny test models)
        return None


def tensor_parallel_group(llm) -> tuple[object, int, int]:
    """(the torch.distributed group of the engine's tensor-parallel ranks, this rank in it, its size).
    vLLM keeps it process-wide (`parallel_state.get_tp_group()`); its `device_group` is the one for
    tensors on the engine's device (gloo on CPU)."""
    from vllm.distributed import parallel_state

    engine_worker(llm)  # an in-process engine: its groups are this process's
    coordinator = parallel_state.get_tp_group()
    return coordinator.device_group, coordinator.rank_in_group, coordinator.world_size


def engine_hf_config(llm):
    """The transformers config the engine was built from, as vLLM holds it (vLLM edits some fields:
    a `sliding_window` of 0 becomes None, ...)."""
    return llm.llm_engine.model_config.hf_config


def engine_model_source(llm) -> dict:
    """Where the engine's model came from, as transformers' from_pretrained takes it: the directory or hub
    name, its revision and whether its code is trusted."""
    model_config = llm.llm_engine.model_config
    return dict(pretrained_model_name_or_path=model_config.model, revision=model_config.revision,
                trust_remote_code=model_config.trust_remote_code)


def engine_config_as_saved(llm):
    """The engine's model config as its directory has it, before vLLM's edits: what a trainer's
    transformers model is built from (transformers reads those fields its own way)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(**engine_model_source(llm))


def request_errors() -> tuple[type, ...]:
    """The exceptions vLLM raises for a request it refuses (the caller's fault: a grammar that does not
    parse, a sampling setting out of range), as opposed to the engine failing."""
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError,)


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


def whole_prefill_options(device_type: str, sequences: int, sequence_tokens: int) -> dict:
    """vLLM options so that no request's prompt is split over engine steps, where that breaks: on a CPU
    vLLM 0.32 rewinds a seeded request's random generator after a partial prefill
    (v1/worker/gpu_model_runner.py, _bookkeeping_sync: gen.set_offset), which a CPU torch.Generator
    cannot do ("CPU Generator does not use offset"), so a seeded batch whose prompts together exceed the
    step's token budget crashes. A budget of every sequence's tokens prefills them in one step."""
    if device_type != "cpu":
        return {}
    return {"max_num_batched_tokens": max(sequences * sequence_tokens, 8192)}


def native_rope_options(model_dir, device_type: str, llm_kwargs: dict) -> dict:
    """`llm_kwargs` with vLLM's CPU rotary op switched off where it serves the wrong function: vLLM
    0.32's `torch.ops._C.rotary_embedding` on a CPU (csrc/cpu/pos_encoding.cpp) takes the number of heads
    from the query's last dimension and the token stride from its second to last, which holds for a
    [tokens, heads x dim] query; the MLA attention of DeepSeek-V2/V3-style models (a config with
    `kv_lora_rank`) hands it the rope part of q as a [tokens, heads, dim] view, whose rows the op then
    rotates at the wrong positions: an eager engine serves another function than the model (the first
    position alone agrees). Compiled engines run vLLM's native rope, which is right; the switch is vLLM's own
    (compilation_config.custom_ops "-rotary_embedding"), and the user's "+rotary_embedding" wins."""
    if device_type != "cpu" or not _has_mla(model_dir):
        return llm_kwargs
    config = llm_kwargs.get("compilation_config")
    if config is None:
        config = {}
    if isinstance(config, dict):
        ops = list(config.get("custom_ops") or [])
        if "+rotary_embedding" not in ops and "-rotary_embedding" not in ops:
            ops.append("-rotary_embedding")
        return {**llm_kwargs, "compilation_config": {**config, "custom_ops": ops}}
    ops = getattr(config, "custom_ops", None)  # a CompilationConfig object: its list, amended
    if ops is not None and "+rotary_embedding" not in ops and "-rotary_embedding" not in ops:
        ops.append("-rotary_embedding")
    return llm_kwargs


def decode_refusal(llm) -> str | None:
    """Why this engine cannot decode (None: it can), found by decoding two tokens, for MLA engines on a
    CPU only: vLLM 0.32 gives MLA a 16-token KV block there (platforms/cpu.py, "the CPU MLA decode
    kernel only compiles with block_size=16") and the CPU wheel's kernel then refuses that block size at
    the first decode; prefill works. A trainer that needs generation says so before its first step."""
    config = llm.llm_engine.vllm_config
    if platform_device_type() != "cpu" or not getattr(config.model_config, "use_mla", False):
        return None
    from vllm import SamplingParams

    try:
        llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    except RuntimeError as e:
        return (f"vLLM {import_vllm().__version__} cannot decode this MLA model on this CPU: its first decode "
                f"raised {e!r} (KV blocks of {config.cache_config.block_size} tokens)")
    return None


def _has_mla(model_dir) -> bool:
    """Whether the model's attention is MLA (vLLM's is_deepseek_mla: a `kv_lora_rank` in the language
    model's config), read from config.json without building the config."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    fields = json.loads(path.read_text())
    text = fields.get("text_config") or fields.get("language_config") or {}
    return fields.get("kv_lora_rank") is not None or text.get("kv_lora_rank") is not None


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


# --- lifecycle -------------------------------------------------------------------------------------

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


class RequestHooks:
    """colo's one wrapper around an engine's requests: the instance's `_add_request` (vLLM's one entry
    for new requests) and its engine's `step` are this object's methods, installed once
    (`request_hooks`), and every colo rule about requests registers here, in any order:

    checks: run before every new request and every engine step (each raises to refuse them);
        request_guard adds one.
    default_lora_request: the adapter a request that names none gets (None: vLLM's own rule, no
        adapter); serve_adapter_by_default sets it.

    It holds the engine weakly (vLLM's class functions called on weakrefs): a closure over the
    engine's bound method stored on the instance would make the engine reference itself and outlive
    its last user. release_engine removes it.
    """

    def __init__(self, llm):
        self._llm, self._engine = weakref.ref(llm), weakref.ref(llm.llm_engine)
        self.checks: list = []
        self.default_lora_request = None

    def _run_checks(self) -> None:
        for check in list(self.checks):
            check()

    def add_request(self, prompt, params, lora_request=None, **kwargs):
        self._run_checks()
        llm = self._llm()
        return type(llm)._add_request(llm, prompt, params, lora_request=lora_request or self.default_lora_request,
                                      **kwargs)

    def step(self, *args, **kwargs):
        self._run_checks()
        engine = self._engine()
        return type(engine).step(engine, *args, **kwargs)


_HOOKS = "colo_request_hooks"  # the attribute of the vllm.LLM instance that holds its RequestHooks


def request_hooks(llm) -> RequestHooks:
    """The engine's RequestHooks, installed on first use (replacing `_add_request` and `step` on the
    instances, never on vLLM's classes)."""
    hooks = vars(llm).get(_HOOKS)
    if hooks is None:
        hooks = RequestHooks(llm)
        llm._add_request = hooks.add_request
        llm.llm_engine.step = hooks.step
        setattr(llm, _HOOKS, hooks)
    return hooks


def request_guard(llm, check) -> None:
    """Make `check()` run before every new request and engine step (it raises to refuse them)."""
    request_hooks(llm).checks.append(check)


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
    for attr in ("_add_request", _HOOKS, "colo_shared_weights"):
        vars(llm).pop(attr, None)
    engine = getattr(llm, "llm_engine", None)
    if engine is not None:
        vars(engine).pop("step", None)
    keep_process_groups(llm)
    gc.unfreeze()  # vLLM gc.freeze()s everything alive after start-up


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
