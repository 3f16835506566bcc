"""vLLM's model registry: what an engine's model class supports, inspected in this process.

vLLM registers its own architectures lazily (`_LazyRegisteredModel`: module and class names) and, when
its modelinfos cache (VLLM_CACHE_ROOT/modelinfos, one file per class, keyed by the module's hash) has
no entry for a class, inspects the class in a new Python process that imports vLLM again
(`_run_in_subprocess`), so as not to initialise CUDA in the parent: once per architecture and vLLM
release on a machine, a whole vLLM import each time. colo's engines run in this process and import the
model class here anyway (vLLM's load_model does, with V1 multiprocessing off), so colo inspects it here
and writes the entry with the registry's own cache methods; vLLM then reads it, in this process and in
any other (a stock baseline's included).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path


def inspect_in_this_process(model_dir: str) -> list[str]:
    """Fill vLLM's modelinfos cache for the architectures `model_dir`'s config.json names, where vLLM
    registered them lazily and the cache has no current entry; returns those filled. A directory without
    a config, an architecture vLLM does not know or a module that does not import is left to vLLM, which
    reports it."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        return []
    with open(config_path) as f:
        architectures = json.load(f).get("architectures") or []
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _LazyRegisteredModel, _ModelInfo

    filled = []
    for arch in architectures:
        entry = ModelRegistry.models.get(arch)
        if not isinstance(entry, _LazyRegisteredModel):
            continue
        try:
            spec = importlib.util.find_spec(entry.module_name)
            module_hash = entry._get_modelinfo_module_hash(Path(spec.origin))
            if entry._load_modelinfo_from_cache(module_hash) is not None:
                continue
            info = _ModelInfo.from_model_cls(entry.load_model_cls())
        except Exception:  # noqa: BLE001 - vLLM's own inspection raises it with its context
            continue
        entry._save_modelinfo_to_cache(info, module_hash)
        filled.append(arch)
    return filled


def unserved_architectures(config) -> str | None:
    """Why vLLM cannot serve a model of transformers `config`, in words, or None where it can: none of
    its architectures is one vLLM implements, nor one transformers implements in a way vLLM's
    Transformers backend takes (vLLM's own test in ModelRegistry's backend lookup). Remote code
    (`auto_map`) is left to vLLM."""
    import transformers
    from vllm import ModelRegistry

    architectures = list(getattr(config, "architectures", None) or ())
    if not architectures or getattr(config, "auto_map", None):
        return None
    supported = set(ModelRegistry.get_supported_archs())
    for arch in architectures:
        if arch in supported:
            return None
        model_class = getattr(transformers, arch, None)
        if model_class is not None and (model_class.is_backend_compatible()
                                        or model_class._can_set_attn_implementation()):
            return None
    return (f"vLLM serves none of its architectures ({', '.join(architectures)}): it implements none of them, and "
            "transformers' implementation is not one its Transformers backend can run")


def lora_refusal(config) -> str | None:
    """Why vLLM's engine takes no LoRA adapter for a model of transformers `config` (its model class is
    not SupportsLoRA: vLLM refuses it once the weights are loaded), in words, or None where it takes one
    or colo cannot tell (an architecture it does not implement is the Transformers backend's, remote
    code is vLLM's to judge)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    architectures = list(getattr(config, "architectures", None) or ())
    if not architectures or getattr(config, "auto_map", None):
        return None
    for arch in architectures:
        model_class = ModelRegistry._try_load_model_cls(arch)
        if model_class is None or supports_lora(model_class):
            return None
    return (f"vLLM's {', '.join(architectures)} takes no LoRA adapter (its model class does not support LoRA), so "
            "colo has no adapter slot to train: train it without an adapter (full fine-tuning)")
