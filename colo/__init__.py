"""colo: colocated RL training and vLLM serving on one device, one memory pool, one copy of the weights."""
from __future__ import annotations

from ._build import build_info, cuda_available, cuda_unavailable_reason
from .errors import OutOfMemoryError, RegionAsleepError
from .pool import Event, Pool, Region, Stream

__version__ = "0.1.0"


def share_weights(hf_model, llm, **kwargs):
    """Make a Hugging Face model and an in-process vLLM engine share one copy of the weights.

    See `colo.weights.share_weights`; imported lazily so `import colo` does not import vLLM.
    """
    from .weights import share_weights as _share_weights

    return _share_weights(hf_model, llm, **kwargs)


__all__ = [
    "Pool", "Region", "Stream", "Event", "OutOfMemoryError", "RegionAsleepError",
    "build_info", "cuda_available", "cuda_unavailable_reason", "share_weights", "__version__",
]
