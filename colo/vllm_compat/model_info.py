"""vLLM's model registry: the model class an engine serves, inspected in this process.

vLLM registers its own architectures lazily (`_LazyRegisteredModel`: module and class names) and, when
its modelinfos cache (VLLM_CACHE_ROOT/modelinfos) has no entry for a class, inspects the class in a
new Python process that imports vLLM again (`_run_in_subprocess`), so as not to initialise CUDA in
the parent. That happens once per architecture and vLLM release on a machine, each time taking a
whole vLLM import. colo's engines run in this process and import the model class here anyway (vLLM's
load_model does, with V1 multiprocessing off), so colo registers the class itself through the public
`ModelRegistry.register_model(arch, cls)`, which vLLM inspects in the process that registered it.
"""
from __future__ import annotations

import json
import os


def inspect_in_this_process(model_dir: str) -> list[str]:
    """Register the architectures that `model_dir`'s config.json names, where vLLM registered them lazily,
    as their classes (imported here); returns those registered. A directory without a config, an
    architecture vLLM does not know or a module that does not import is left to vLLM, which reports it."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        return []
    with open(config_path) as f:
        architectures = json.load(f).get("architectures") or []
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    registered = []
    for arch in architectures:
        entry = ModelRegistry.models.get(arch)
        if not isinstance(entry, _LazyRegisteredModel):
            continue
        try:
            model_cls = entry.load_model_cls()
        except Exception:  # noqa: BLE001 - vLLM's own inspection raises it with its context
            continue
        ModelRegistry.register_model(arch, model_cls)
        registered.append(arch)
    return registered
