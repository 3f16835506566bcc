"""Random allocation workloads against a reference model (hypothesis), and bounded fragmentation."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pools import MiB, POOL_KINDS, make_pool

ALIGN = 256

# An op is ("alloc", size) or ("free", index into the live list, modulo its length).
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.one_of(st.integers(0, 4096), st.integers(4096, 3 * MiB))),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@pytest.mark.parametrize("kind", POOL_KINDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops_strategy)
def test_random_alloc_free_matches_reference_model(kind, ops):
    budget = 32 * MiB
    region = make_pool(kind).region("train", budget=budget)
    live = []  # (tensor, size, fill byte)
    expected_bytes = 0
    for op, arg in ops:
        if op == "alloc":
            rounded = max(ALIGN, -(-arg // ALIGN) * ALIGN)
            before = region.stats()
            if expected_bytes + rounded > budget:
                with pytest.raises(MemoryError):
                    region.empty((arg,), dtype=torch.uint8)
                assert region.stats()["allocated_bytes"] == before["allocated_bytes"]
                continue
            try:
                t = region.empty((arg,), dtype=torch.uint8)
            except MemoryError:  # within budget but fragmented: allowed, and must change nothing
                assert region.stats()["allocated_bytes"] == before["allocated_bytes"]
                continue
            fill = len(live) % 251 + 1
            t.fill_(fill)
            live.append((t, arg, fill))
            expected_bytes += rounded
        elif live:
            t, size, fill = live.pop(arg % len(live))
            assert torch.all(t == fill), "a block was overwritten by another allocation"
            expected_bytes -= max(ALIGN, -(-size // ALIGN) * ALIGN)
            del t
        assert region.stats()["allocated_bytes"] == expected_bytes
    # No two live blocks overlap (torch reports a null data_ptr for empty tensors: skip those).
    spans = sorted((t.data_ptr(), t.data_ptr() + size) for t, size, _ in live if size)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    live.clear()
    t = None  # the loop variable holds the last tensor
    assert region.stats()["allocated_bytes"] == 0
    assert region.stats()["num_allocations"] == 0


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_committed_memory_stays_close_to_peak_live_bytes(kind):
    """Under a long random workload, committed memory tracks the live high-water mark."""
    region = make_pool(kind).region("train", budget=1 << 30)
    rng = random.Random(0)
    live = []
    for step in range(3000):
        if live and (rng.random() < 0.5 or len(live) > 200):
            live.pop(rng.randrange(len(live)))
        else:
            # Skewed toward small sizes, like activations and gradients of a small model.
            size = int(min(8 * MiB, rng.lognormvariate(10, 2.5))) + 1
            live.append(region.empty((size,), dtype=torch.uint8))
    stats = region.stats()
    chunk = stats["chunk_bytes"]
    assert stats["committed_bytes"] <= 1.5 * stats["peak_allocated_bytes"] + 4 * chunk, stats
