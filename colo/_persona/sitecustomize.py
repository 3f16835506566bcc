"""Loaded at start-up by every Python process that runs under `python -m colo.cpu_persona`
(this folder is put first on PYTHONPATH): torch.cpu.get_capabilities(), from which torch.cpu's
`_is_avx512_supported`, `_is_avx512_bf16_supported`, `_is_amx_tile_supported`, ... answer (and so
vLLM's choice of native build and kernels), stops reporting the features the persona lacks.

torch is not imported here (most processes, pip or cmake among them, never need it): the patch is
applied when torch.cpu is first imported.
"""
import importlib.abc
import importlib.util
import os
import sys


def _persona_capabilities(original, hidden):
    import functools
    from types import MappingProxyType

    @functools.lru_cache(None)
    def get_capabilities():
        return MappingProxyType({k: (False if isinstance(v, bool) and k.startswith(hidden) else v)
                                 for k, v in original().items()})

    get_capabilities.__doc__ = original.__doc__
    return get_capabilities


class _PatchTorchCpu(importlib.abc.MetaPathFinder):
    def __init__(self, hidden):
        self.hidden = hidden

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)  # find the real module, then wrap its loader
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, hidden = spec.loader.exec_module, self.hidden

        def exec_and_patch(module):
            exec_module(module)
            module.get_capabilities = _persona_capabilities(module.get_capabilities, hidden)

        spec.loader.exec_module = exec_and_patch
        return spec


def _install():
    hidden = tuple(f for f in os.environ.get("COLO_CPU_PERSONA_HIDES", "").split(",") if f)
    if os.environ.get("COLO_CPU_PERSONA") and hidden:
        sys.meta_path.insert(0, _PatchTorchCpu(hidden))


_install()
