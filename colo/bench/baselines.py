"""What a user runs without colo, written once for every section that compares with it.

- `trl_sync_weights`: TRL 1.16's colocate weight sync (`VLLMGeneration.sync_weights`): one
  `model.load_weights([(name, param)])` call per trainer parameter, then `llm.reset_prefix_cache()`.
- `stock_llm`: vLLM as a user builds it, in its default mode (compiled; CUDA graphs on a GPU; on a
  CPU the GEMM kernels vLLM picks), in this process as TRL's colocate mode runs it. kernel="plain"
  builds the named variant whose linears run F.linear, the one stock engine on a CPU that can take
  new weights in place (see `stock_update_refused`).
"""
from __future__ import annotations

import contextlib

PACKED_KERNELS = ("sgl", "onednn", "zentorch")
UPDATABLE_VARIANT = "vLLM with its packed CPU kernels disabled (F.linear), compiled"


def trl_sync_weights(llm, hf_model) -> dict:
    """TRL's colocate sync, as its `sync_weights` runs for a model without FSDP, DeepSpeed or PEFT:
    every `named_parameters()` entry's `.data` through vLLM's own load_weights, one call each (TRL's
    name fix only strips wrapper prefixes such a model does not have), in the caller's grad mode
    (TRL calls it outside torch.no_grad), then a prefix-cache reset."""
    from colo.engine import engine_model, reset_prefix_cache
    from colo.sizes import tensor_bytes

    model = engine_model(llm)
    for name, param in hf_model.named_parameters():
        model.load_weights([(name, param.data)])
    reset_prefix_cache(llm)
    return {"bytes_copied": tensor_bytes(hf_model.parameters())}


def stock_llm(model_dir, *, dtype: str, kernel: str | None = None, **llm_kwargs):
    """A vllm.LLM built the stock way (no colo worker), in this process, vLLM's default mode.
    kernel: force vLLM's CPU GEMM choice (colo.vllm_compat.forced_kernels.forced_cpu_gemm), e.g. "plain"."""
    from colo.engine import import_vllm, in_process_env
    from colo.vllm_compat.forced_kernels import forced_cpu_gemm

    vllm = import_vllm()
    with in_process_env(), (forced_cpu_gemm(kernel) if kernel else contextlib.nullcontext()):
        return vllm.LLM(model=str(model_dir), dtype=dtype, seed=0, skip_tokenizer_init=True, **llm_kwargs)


def packed_layers(kernels: dict) -> int:
    return sum(n for kernel, n in kernels.items() if kernel in PACKED_KERNELS)


def stock_update_refused(kernels: dict) -> str:
    """Why stock vLLM cannot take new weights in place with these CPU kernels ('' when it can): the
    packed kernels replace each layer's weight by an empty Parameter without a weight_loader, so
    load_weights raises (stock TRL crashes at its first weight sync)."""
    packed = packed_layers(kernels)
    if not packed:
        return ""
    return (f"vLLM packed {packed} CPU linear layers ({', '.join(k for k in kernels if k in PACKED_KERNELS)}) and "
            "emptied their weights, so load_weights cannot write them (AttributeError: no weight_loader)")


def try_trl_sync(llm, hf_model) -> str:
    """Run TRL's sync once on a stock engine; '' when it works, else the error it raised."""
    try:
        trl_sync_weights(llm, hf_model)
    except Exception as e:  # noqa: BLE001 - the error is the finding
        return f"{type(e).__name__}: {e}"
    return ""
