"""What was compiled into colo._C, and whether CUDA can be used on this machine."""
from __future__ import annotations

import functools
import logging

from . import _C

log = logging.getLogger("colo")


@functools.lru_cache(maxsize=None)
def _probe() -> dict:
    probe = dict(_C.probe_cuda())
    if not probe["available"]:
        log.info("colo: CUDA is unavailable: %s; the host backend is used", probe["reason"])
    return probe


def cuda_available() -> bool:
    """True when colo was built with its CUDA backend and a CUDA device can be used here."""
    return bool(_probe()["available"])


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot be used ('' when it can)."""
    return "" if cuda_available() else str(_probe()["reason"])


def build_info() -> dict:
    """Which backends were compiled, against which CUDA version, and what this machine offers.

    Keys: backends, cuda_compiled, cuda_version ('' when built without CUDA), compiler, sanitizer,
    cuda_available, cuda_unavailable_reason, cuda_device_count, cuda_driver_version.
    """
    info = dict(_C.build_info())
    info["torch_allocator_symbols"] = tuple(info["torch_allocator_symbols"])
    probe = _probe()
    info.update(
        cuda_available=bool(probe["available"]),
        cuda_unavailable_reason="" if probe["available"] else str(probe["reason"]),
        cuda_device_count=int(probe["device_count"]),
        cuda_driver_version=int(probe["driver_version"]),
    )
    return info
