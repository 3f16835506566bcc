"""CUDA-only pool behaviour: torch's own allocations routed into a region through MemPool, and the
pool's streams used by torch. Run on a GPU machine with `python -m pytest -m cuda`."""
import pytest
import torch

import colo
from helpers.pools import MiB

pytestmark = pytest.mark.cuda


@pytest.fixture
def pool():
    if not colo.cuda_available():
        pytest.fail(f"`-m cuda` needs a GPU: {colo.cuda_unavailable_reason()}")
    return colo.Pool("cuda")


def test_torch_allocations_inside_use_land_in_the_region(pool):
    train = pool.region("train", budget=512 * MiB)
    with pool.use("train"):
        x = torch.empty((64, MiB), dtype=torch.uint8, device="cuda")
    assert train.contains(x)
    assert train.stats()["allocated_bytes"] >= 64 * MiB
    y = torch.empty((MiB,), dtype=torch.uint8, device="cuda")
    assert not train.contains(y)  # outside the block: torch's default pool


def test_routed_memory_sleeps_and_wakes_with_offload(pool):
    train = pool.region("train", budget=512 * MiB)
    with pool.use("train"):
        x = torch.randn((4096, 4096), device="cuda")
    expected = x.clone()
    address = x.data_ptr()
    train.sleep(offload=True)
    assert train.stats()["resident_bytes"] == 0
    train.wake()
    assert x.data_ptr() == address and torch.equal(x, expected)


def test_pool_streams_are_usable_by_torch(pool):
    weights = pool.region("weights", budget=64 * MiB)
    w = weights.empty((1024, 1024)).normal_()
    train, infer = pool.stream("train"), pool.stream("infer")
    with torch.cuda.stream(train.torch_stream()):
        w.mul_(2)
    infer.wait(train.record())
    with torch.cuda.stream(infer.torch_stream()):
        out = w.sum()
    infer.synchronize()
    assert torch.isfinite(out)


def test_a_region_larger_than_the_device_is_refused_cleanly(pool):
    with pytest.raises(ValueError, match="exceeds what the pool has left"):
        pool.region("too_big", budget=pool.capacity + 1)
