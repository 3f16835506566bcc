"""Everything colo knows about vLLM's internals, in one package, checked against the vLLM version.

A vLLM upgrade that moves one of these fails here, loudly, rather than somewhere in colo. One module
per topic; this one re-exports their public names (`from colo import vllm_compat as compat;
compat.engine_model(llm)`):

- version: `import_vllm` imports vLLM and checks its version against SUPPORTED_VLLM_VERSIONS (the
  one place colo names them), and picks the compile cache that loads under the pinned torch;
- worker: the worker hook. `ColoWorker`, a subclass of the platform's own worker (`worker_cls`),
  answers vLLM's `_maybe_get_memory_pool_context(tag)`: tag "weights" (around `load_model`) places
  the engine's parameters in the pool's `weights` region, tag "kv_cache" (around the KV cache
  allocation, on both model runners) places the KV cache in the `kv_cache` region. The same
  `colo.placement.AllocateIn` mode does it on the host and on a GPU;
- cpu_gemm: the CPU GEMM kernels (`dispatch_cpu_unquantized_gemm`): vLLM packs each linear weight at
  load (sgl-kernel, oneDNN or zentorch) and drops the weight; colo keeps the weight in the region,
  lets the kernel keep its packed copy, and refreshes that copy in place at publish;
- engine: model access, compile mode, start-up memory, the hooks run before every request and
  engine step (the guard that refuses or wakes requests while the KV cache sleeps, the default
  adapter), teardown; the CPU rotary op off for MLA models (native_rope_options: vLLM's rotates MLA's
  3-D query view wrongly) and whether a CPU MLA engine can decode at all (decode_refusal);
- load_trace: vLLM's own `load_weights` run on meta stand-ins of the trainer's parameters, every write
  recorded instead of done: where each element of each Hugging Face parameter lands;
- layout: from that trace, where each Hugging Face parameter lives (a view of one engine tensor: fused
  q/k/v and gate/up, MoE experts, padded vocabulary, tensor-parallel shards; or pieces to copy);
- trainer_models: trainer models of the families vLLM serves through its Transformers backend, which
  decorates transformers' own classes process-wide;
- routing: the experts a MoE engine routed each request's tokens to (vLLM's own capture where it runs,
  colo's worker's through the same router hook where it does not: route_capture);
- lora_slots: LoRA adapter slots (`lora_a_stacked`/`lora_b_stacked`) the trainer's adapter is a view
  of, and a one-adapter fast path for vLLM's CPU punica wrapper;
- model_info: the served model's class inspected in this process, into vLLM's own modelinfos cache,
  rather than by vLLM in a new process that imports vLLM again;
- runner_memory: what the model runner allocates in load_model beside the weights, so in the weights
  region (Model Runner V2's sampler buffers: max_num_seqs x vocab), for callers that size the KV cache;
- forced_kernels: forcing vLLM's CPU GEMM choice, for benchmark baselines and tests only. Not
  re-exported here: colo's runtime never imports it (import colo.vllm_compat.forced_kernels).
"""
from __future__ import annotations

from .version import SUPPORTED_VLLM_VERSIONS, check_version, import_vllm
from .worker import WORKER_CLS, EnginePlacement, job_init_method, placing
from .cpu_gemm import CpuLinear, CpuPackedExperts, cpu_linear_modules, restore_emptied_weights
from .load_trace import Strided, checkpoint_tensors, persistent_buffers
from .layout import (EngineLayout, EngineTensor, Piece, Placement, engine_layout, lm_head_names, lora_base_name,
                     solve_view)
from .trainer_models import building_trainer_models, run_as_plain_modules
from .routing import engine_routing_options, recording_routes, routed_experts
from .engine_access import (
    FIXED_KV_MEMORY_FRACTION, STARTUP_HEADROOM_BYTES, VLLM_DEFAULT_MEMORY_FRACTION, RequestHooks, decode_refusal,
    engine_config_as_saved,
    engine_dtype, engine_hf_config, engine_kv_caches, engine_model, engine_model_source, engine_placement,
    engine_tokenizer, engine_worker, external_request_id, image_attention_is_causal, is_compiled, keep_process_groups,
    kv_cache_block_count,
    native_rope_options, platform_device_type,
    quiet_chat_warmup_without_tokenizer, release_engine, request_errors, request_guard, request_hooks, served_dtype,
    startup_memory_fraction, tensor_parallel_group, whole_prefill_options,
)
from .model_info import inspect_in_this_process, lora_refusal, unserved_architectures
from .runner_memory import sampler_buffer_bytes, uses_model_runner_v2
from .lora_slots import (
    LORA_SLOT_RANKS, AdapterSlice, activate_adapter, adapter_slices, adapter_slot, check_shareable_lora,
    engine_module_names, has_lora_slots, lora_engine_options, one_adapter_fast_path, punica_wrappers,
    serve_adapter_by_default,
)

__all__ = [
    "SUPPORTED_VLLM_VERSIONS", "check_version", "import_vllm",
    "WORKER_CLS", "EnginePlacement", "job_init_method", "placing",
    "CpuLinear", "CpuPackedExperts", "cpu_linear_modules", "restore_emptied_weights",
    "Strided", "checkpoint_tensors", "persistent_buffers",
    "EngineLayout", "EngineTensor", "Piece", "Placement", "engine_layout", "lm_head_names", "lora_base_name",
    "solve_view",
    "building_trainer_models", "run_as_plain_modules", "engine_routing_options", "recording_routes", "routed_experts",
    "FIXED_KV_MEMORY_FRACTION", "STARTUP_HEADROOM_BYTES", "VLLM_DEFAULT_MEMORY_FRACTION", "RequestHooks",
    "decode_refusal",
    "engine_config_as_saved", "engine_dtype", "engine_hf_config", "engine_kv_caches", "engine_model", "engine_model_source",
    "engine_placement", "engine_tokenizer", "engine_worker",
    "external_request_id", "image_attention_is_causal", "is_compiled", "keep_process_groups", "kv_cache_block_count",
    "native_rope_options",
    "platform_device_type",
    "quiet_chat_warmup_without_tokenizer", "release_engine", "request_guard", "request_hooks", "served_dtype",
    "startup_memory_fraction", "request_errors", "tensor_parallel_group", "whole_prefill_options",
    "LORA_SLOT_RANKS", "AdapterSlice", "activate_adapter", "adapter_slices", "adapter_slot", "check_shareable_lora",
    "engine_module_names", "has_lora_slots", "lora_engine_options", "one_adapter_fast_path", "punica_wrappers",
    "serve_adapter_by_default",
    "inspect_in_this_process", "lora_refusal", "unserved_architectures", "sampler_buffer_bytes", "uses_model_runner_v2",
]


def __getattr__(name: str):
    # ColoWorker is built on first use in .worker: its base is the platform's own worker, and importing
    # that imports the platform's dependencies (so it is left out of __all__: `import *` imports no
    # vLLM). vLLM itself is handed WORKER_CLS, the class's own path in .worker.
    if name == "ColoWorker":
        from . import worker

        return worker.ColoWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
