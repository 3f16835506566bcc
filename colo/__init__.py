"""colo: colocated RL training and vLLM serving on one device, one memory pool, one copy of the weights.

The compiled core (colo._C) is loaded on first use of a name that needs it, so tools that only
parse arguments (`python -m colo.bench --help`) work even where the extension is not built.
"""
from __future__ import annotations

import importlib
import os
import sys

from .errors import CheckpointError, ColoError, EngineFailure, OutOfMemoryError, RegionAsleepError, Terminated

__version__ = "0.1.0"


def _huge_pages_for_torch_tensors() -> None:
    """torch's CPU tensors of 2 MiB and more on transparent huge pages (torch's THP_MEM_ALLOC_ENABLE), unless
    the user set the variable (0 turns it off). A training step allocates its logits, activations and
    gradients afresh; on 4 KiB pages each new tensor's first write faults page by page, which costs more than
    the arithmetic of the elementwise operations that make them (bench/results/cpu-huge-pages-zen5.json).
    torch reads the variable once, at its first allocation: after `import torch` it is too late, so nothing
    is set then."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


_huge_pages_for_torch_tensors()

# name -> submodule that defines it (importing the submodule loads colo._C)
_LAZY = {
    "Pool": "pool", "Region": "pool", "Stream": "pool", "Event": "pool",
    "build_info": "_build", "cuda_available": "_build", "cuda_unavailable_reason": "_build",
    "MasterWeightOptimizer": "mixed_precision", "ShardedMasterWeightOptimizer": "zero",
    "refuse_non_finite_steps": "clipping",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'colo' has no attribute {name!r}")


def share_weights(hf_model, llm, **kwargs):
    """Make a Hugging Face model and an in-process vLLM engine share one copy of the weights.

    See `colo.weights.share_weights`; imported lazily so `import colo` does not import vLLM.
    """
    from .weights import share_weights as _share_weights

    return _share_weights(hf_model, llm, **kwargs)


def shared_model(llm, dtype=None, **kwargs):
    """A Hugging Face model whose parameters are the in-process engine's own tensors (0 bytes copied).

    See `colo.weights.shared_model`; imported lazily so `import colo` does not import vLLM.
    """
    from .weights import shared_model as _shared_model

    return _shared_model(llm, dtype, **kwargs)


__all__ = [*_LAZY, "ColoError", "OutOfMemoryError", "RegionAsleepError", "EngineFailure", "CheckpointError", "Terminated", "share_weights", "shared_model", "__version__"]
