"""Shared helpers for the pool tests: which pools to run against, and process memory readings."""
import os

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


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
