"""Shared helpers for the pool tests: which pools to run against."""
import pytest

import colo

MiB = 1 << 20

# Every pool test runs against each backend with the same semantics (RMM's typed-suite habit).
POOL_KINDS = [
    pytest.param("cpu-anon", id="cpu-anon"),
    pytest.param("cpu-memfd", id="cpu-memfd"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


def make_pool(kind: str, **kwargs) -> colo.Pool:
    if kind == "cuda":
        return colo.Pool("cuda", **kwargs)
    return colo.Pool("cpu", host_backend=kind.split("-")[1], **kwargs)
