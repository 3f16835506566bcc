"""The pool's regions: allocation, budgets, sleep/wake at stable addresses, offload, errors."""
import threading
import time

import pytest
import torch

import colo
from colo.sizes import rss_bytes
from helpers.pools import MiB, POOL_KINDS, make_pool


@pytest.fixture(params=POOL_KINDS)
def pool(request):
    return make_pool(request.param)


def _random_bytes(n, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def test_empty_returns_a_tensor_in_region_memory(pool):
    region = pool.region("weights", budget=64 * MiB)
    t = region.empty((3, 5), dtype=torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == pool.device.type
    assert region.contains(t)
    assert t.data_ptr() % 256 == 0
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * 15
    assert region.stats()["allocated_bytes"] == 256  # rounded to the 256-byte alignment


def test_tensor_death_returns_memory_and_trim_releases_it(pool):
    region = pool.region("train", budget=64 * MiB)
    tensors = [region.empty(n * 1000, dtype=torch.float32) for n in range(1, 50)]
    assert region.stats()["num_allocations"] == 49
    del tensors
    stats = region.stats()
    assert stats["allocated_bytes"] == 0 and stats["num_allocations"] == 0
    assert stats["peak_allocated_bytes"] > 0
    region.trim()
    assert region.stats()["committed_bytes"] == 0
    assert region.stats()["resident_bytes"] == 0


def test_cpu_tensors_free_at_once_without_asking_torch_cuda_for_a_stream(monkeypatch):
    # Only CUDA pools order frees after a stream's work; host tensors compute synchronously.
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU pool asked torch.cuda for its current stream")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    region = colo.Pool("cpu").region("kv_cache", budget=4 * MiB)
    for dtype in (torch.uint8, torch.complex64):  # a DLPack dtype, and one viewed from bytes
        t = region.empty(MiB // 8, dtype=dtype)
        address = t.data_ptr()
        del t
        assert region.stats()["pending_free_bytes"] == 0 and region.stats()["allocated_bytes"] == 0
        assert region.empty(MiB // 8, dtype=dtype).data_ptr() == address


def test_views_keep_memory_alive(pool):
    region = pool.region("kv_cache", budget=16 * MiB)
    view = region.empty((4, 1024)).view(-1)[100:200]
    assert region.stats()["allocated_bytes"] == 4 * 1024 * 4
    del view
    assert region.stats()["allocated_bytes"] == 0


def test_tensor_outlives_its_pool_object(pool):
    region = pool.region("weights", budget=16 * MiB)
    t = region.empty(1000).fill_(2.0)
    del region, pool
    assert float(t.sum()) == 2000.0  # the C++ region stays alive while torch holds its memory


def test_autograd_and_optimizer_work_on_region_tensors(pool):
    region = pool.region("weights", budget=16 * MiB)
    w = torch.nn.Parameter(region.empty((8, 8)).normal_())
    before = w.detach().clone()
    loss = (w @ torch.ones(8, device=w.device)).square().sum()
    loss.backward()
    torch.optim.SGD([w], lr=0.1).step()
    assert region.contains(w) and not torch.equal(w.detach(), before)


def test_sleep_releases_memory_and_wake_keeps_addresses(pool):
    region = pool.region("kv_cache", budget=256 * MiB)
    t = region.empty((64 * MiB,), dtype=torch.uint8).fill_(7)  # touch every page
    address = t.data_ptr()
    awake = region.stats()
    assert awake["resident_bytes"] >= 64 * MiB
    rss_before = rss_bytes()
    region.sleep()
    asleep = region.stats()
    assert asleep["asleep"] and asleep["resident_bytes"] == 0 and asleep["committed_bytes"] == 0
    assert asleep["allocated_bytes"] == awake["allocated_bytes"]  # allocations survive sleep
    if pool.device.type == "cpu":
        assert rss_before - rss_bytes() >= 0.95 * 64 * MiB  # really returned to the OS
    region.wake()
    assert t.data_ptr() == address
    t.fill_(9)  # usable again at the same address
    assert int(t[-1]) == 9
    assert region.stats()["resident_bytes"] >= 64 * MiB


def test_wake_faults_the_memory_in_without_a_touch(pool):
    region = pool.region("grads", budget=64 * MiB)
    t = region.empty((32 * MiB,), dtype=torch.uint8).fill_(5)
    region.sleep()
    region.wake()
    # Faulted in on the region's copy stream, in the background: wait for it, touching nothing.
    deadline = time.monotonic() + 30
    while region.stats()["resident_bytes"] < 32 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    assert region.stats()["resident_bytes"] >= 32 * MiB
    if region.wakes_zeroed:
        assert int(t.count_nonzero()) == 0  # contents were discarded: fresh zero pages
    region.sleep()  # waits for any prefault still running, then releases everything
    assert region.stats()["resident_bytes"] == 0


def test_wake_without_fault_in_brings_in_only_what_is_touched(pool):
    region = pool.region("kv_cache", budget=64 * MiB)
    t = region.empty((32 * MiB,), dtype=torch.uint8).fill_(5)
    region.sleep()
    region.wake(fault_in=False)
    time.sleep(0.2)  # time enough for a prefault, had one been queued
    if pool.device.type == "cpu":
        assert region.stats()["resident_bytes"] == 0
    t[: 4 * MiB].fill_(7)  # usable at once; a touch brings its pages in
    assert int(t[4 * MiB - 1]) == 7
    resident = region.stats()["resident_bytes"]
    assert 4 * MiB <= resident and (pool.device.type != "cpu" or resident < 32 * MiB)
    region.sleep()
    with pytest.raises(TypeError, match="fault_in"):
        region.wake(fault_in="no")
    assert region.asleep  # refused before anything was mapped


def test_offload_round_trip_is_bit_exact(pool):
    region = pool.region("weights", budget=128 * MiB)
    sizes = [1, 255, 256, 4097, 3 * MiB + 5, 17]
    tensors = [region.empty((n,), dtype=torch.uint8) for n in sizes]
    expected = [_random_bytes(n, seed, pool.device) for seed, n in enumerate(sizes)]
    for t, e in zip(tensors, expected):
        t.copy_(e)
    floats = region.empty((1000,), dtype=torch.float64).normal_()
    floats_expected = floats.clone()
    addresses = [t.data_ptr() for t in tensors]
    region.sleep(offload=True)
    assert region.stats()["offloaded_bytes"] >= sum(sizes)
    assert region.stats()["resident_bytes"] == 0
    region.wake()
    assert [t.data_ptr() for t in tensors] == addresses
    for t, e in zip(tensors, expected):
        assert torch.equal(t, e)
    assert torch.equal(floats, floats_expected)
    stats = region.stats()
    assert stats["offloaded_bytes"] == 0
    # CUDA keeps the pinned buffer for the next sleep; the host gives it back at once.
    assert (stats["offload_buffer_bytes"] > 0) == (pool.device.type == "cuda")
    region.trim()
    assert region.stats()["offload_buffer_bytes"] == 0


def test_free_while_asleep_then_offload_restores_the_rest(pool):
    region = pool.region("weights", budget=64 * MiB)
    keep = region.empty((5 * MiB,), dtype=torch.uint8).fill_(3)
    drop = region.empty((5 * MiB,), dtype=torch.uint8).fill_(4)
    region.sleep(offload=True)
    del drop
    region.wake()
    assert int(keep.sum()) == 3 * 5 * MiB
    assert region.stats()["allocated_bytes"] == 5 * MiB


@pytest.mark.parametrize("kind", ["cpu-anon", "cpu-memfd"])
def test_a_host_offload_keeps_the_pages_instead_of_copying_them(kind):
    """On the host the "host copy" would be the same RAM: sleep(offload=True) moves the live chunks'
    pages out of the region (anon: mremap; memfd: the file keeps them) and wake puts them back, so no
    buffer is held and nothing is copied; chunks whose blocks were all freed while asleep are dropped."""
    region = make_pool(kind).region("optimizer", budget=64 * MiB)
    kept = region.empty((8 * MiB,), dtype=torch.uint8).fill_(7)
    freed = region.empty((8 * MiB,), dtype=torch.uint8).fill_(9)
    address = kept.data_ptr()
    region.sleep(offload=True)
    asleep = region.stats()
    assert asleep["resident_bytes"] == 0 and asleep["offload_buffer_bytes"] == 0
    assert asleep["offloaded_bytes"] >= 16 * MiB  # whole chunks, kept as they are
    del freed
    region.wake()
    assert kept.data_ptr() == address and int(kept.min()) == int(kept.max()) == 7
    awake = region.stats()
    assert awake["offloaded_bytes"] == 0 and awake["offload_buffer_bytes"] == 0
    assert 8 * MiB <= awake["resident_bytes"] < 16 * MiB  # the freed block's chunks did not come back
    region.sleep(offload=True)  # and again, the same way
    region.wake()
    assert int(kept.sum()) == 7 * 8 * MiB


def test_allocating_in_a_sleeping_region_raises(pool):
    region = pool.region("kv_cache", budget=16 * MiB)
    region.sleep()
    before = region.stats()
    with pytest.raises(colo.RegionAsleepError, match="kv_cache"):
        region.empty(10)
    assert region.stats() == before
    region.wake()
    assert region.empty(10).numel() == 10


def test_budget_is_enforced_and_a_refused_request_changes_nothing(pool):
    region = pool.region("kv_cache", budget=4 * MiB)
    held = region.empty((3 * MiB,), dtype=torch.uint8)
    before = region.stats()
    with pytest.raises(colo.OutOfMemoryError) as info:
        region.empty((2 * MiB,), dtype=torch.uint8)
    message = str(info.value)
    assert "kv_cache" in message and "2.00 MiB" in message and "budget" in message and "free" in message
    assert isinstance(info.value, MemoryError)
    assert region.stats() == before
    assert region.empty((MiB,), dtype=torch.uint8).numel() == MiB  # what does fit still fits
    del held


def test_pool_capacity_is_shared_between_region_budgets():
    pool = colo.Pool("cpu", capacity=100 * MiB)
    pool.region("weights", budget=30 * MiB)
    kv = pool.region("kv_cache")  # no budget: what the others leave
    assert kv.budget == 70 * MiB
    assert pool.unbudgeted_bytes == 0
    with pytest.raises(colo.OutOfMemoryError, match="nothing left"):
        pool.region("train")
    assert pool.region("weights") is pool.regions["weights"]
    with pytest.raises(ValueError, match="already exists"):
        pool.region("weights", budget=10 * MiB)


def test_asleep_regions_lend_their_budgets_to_awake_ones():
    pool = colo.Pool("cpu", capacity=100 * MiB)
    pool.region("weights", budget=30 * MiB)
    grads = pool.region("grads", budget=50 * MiB)
    g = grads.zeros((MiB,), dtype=torch.uint8)
    with pytest.raises(ValueError, match="awake regions: weights=.*grads="):
        pool.region("kv_cache", budget=60 * MiB)
    grads.sleep()
    assert pool.unbudgeted_bytes == 70 * MiB  # the sleeping gradients' 50 MiB are free for others
    kv = pool.region("kv_cache", budget=60 * MiB)  # 30 + 50 + 60 > 100: they time-share
    kv.zeros((MiB,), dtype=torch.uint8)
    with pytest.raises(colo.OutOfMemoryError, match="'grads' cannot wake.*kv_cache=") as info:
        grads.wake()
    assert "put one of them to sleep" in str(info.value)
    assert grads.asleep and g.data_ptr()  # refused: still asleep, its tensor still registered
    kv.sleep()
    grads.wake()
    g.fill_(3)
    assert int(g.sum()) == 3 * MiB
    with pytest.raises(colo.OutOfMemoryError, match="'kv_cache' cannot wake"):
        kv.wake()
    grads.wake()  # waking an awake region is a no-op, not a capacity check
    assert not grads.asleep and kv.asleep


@pytest.mark.parametrize(
    "name, budget, error",
    [
        ("", MiB, ValueError),
        ("has space", MiB, ValueError),
        ("9starts_with_digit", MiB, ValueError),
        (7, MiB, TypeError),
        ("ok", 0, ValueError),
        ("ok", -5, ValueError),
        ("ok", 1.5, TypeError),
        ("ok", True, TypeError),
        ("ok", 1 << 60, ValueError),
    ],
)
def test_bad_region_arguments(name, budget, error):
    pool = colo.Pool("cpu", capacity=1 << 30)
    with pytest.raises(error):
        pool.region(name, budget=budget)
    assert pool.regions == {}


def test_absurd_sizes_are_clear_errors_not_binding_failures():
    with pytest.raises(ValueError, match="larger than colo supports"):
        colo.Pool("cpu", capacity=1 << 70)
    pool = colo.Pool("cpu", capacity=1 << 62)
    with pytest.raises(ValueError, match="chunk_bytes .* larger than colo supports"):
        pool.region("r", budget=MiB, chunk_bytes=1 << 70)
    with pytest.raises(colo.OutOfMemoryError, match="'huge' cannot reserve"):
        pool.region("huge", budget=1 << 60)  # more address space than the process has
    assert "huge" not in pool.regions


@pytest.mark.parametrize("chunk", [None, 8 * MiB, 64 * MiB])
def test_committed_memory_never_exceeds_the_budget(pool, chunk):
    # A budget that is no multiple of the chunk: the last chunk is shorter, not a whole chunk more.
    granule = pool.granularity
    region = pool.region("tight", budget=5 * MiB + 1, chunk_bytes=chunk)
    limit = -(-region.budget // granule) * granule
    held = [region.zeros((MiB // 4,), dtype=torch.uint8) for _ in range(20)]
    assert region.stats()["committed_bytes"] <= limit
    assert region.stats()["resident_bytes"] <= limit
    del held[::2]
    held += [region.zeros((MiB // 4,), dtype=torch.uint8) for _ in range(10)]
    assert region.stats()["committed_bytes"] <= limit


@pytest.mark.parametrize(
    "shape, dtype, error",
    [
        ((-1, 3), torch.float32, ValueError),
        ((2.5,), torch.float32, TypeError),
        ("12", torch.float32, TypeError),
        ((2, 3), "float32", TypeError),
        ((2, 3), float, TypeError),
        ((0, 1 << 64), torch.float32, ValueError),
        ((1 << 40, 1 << 40), torch.float32, colo.OutOfMemoryError),
        ((1 << 62,), torch.bfloat16, colo.OutOfMemoryError),
    ],
)
def test_bad_tensor_arguments(shape, dtype, error):
    region = colo.Pool("cpu").region("r", budget=MiB)
    with pytest.raises(error):
        region.empty(shape, dtype=dtype)
    assert region.stats()["allocated_bytes"] == 0


@pytest.mark.parametrize("device, error", [("tpu", ValueError), ("nonsense:x", ValueError), (3, TypeError)])
def test_bad_devices(device, error):
    with pytest.raises(error):
        colo.Pool(device)


def test_cuda_pool_means_the_current_device(monkeypatch):
    from colo import pool as pool_module

    monkeypatch.setattr(pool_module, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert pool_module._parse_device("cuda") == torch.device("cuda", 3)
    assert pool_module._parse_device("cuda:1") == torch.device("cuda", 1)


def test_sleep_takes_a_real_bool():
    region = colo.Pool("cpu").region("r", budget=MiB)
    with pytest.raises(TypeError, match="offload must be True or False"):
        region.sleep(offload="no")
    assert not region.asleep


def test_bad_host_backend_and_stream_role():
    with pytest.raises(ValueError, match="anon"):
        colo.Pool("cpu", host_backend="nope")
    with pytest.raises(ValueError, match="stream role"):
        colo.Pool("cpu").stream("gpu")


def test_zero_sized_and_many_dtypes(pool):
    region = pool.region("r", budget=MiB)
    assert region.empty((0, 4)).numel() == 0
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int64, torch.bool):
        t = region.empty((3, 7), dtype=dtype)
        assert t.dtype == dtype and t.shape == (3, 7)


def test_copy_stream_copies_in_order_and_keeps_sources_alive(pool):
    region = pool.region("weights", budget=64 * MiB)
    srcs = [torch.full((n,), float(n), device=pool.device) for n in (10, 1000, 100000)]
    dsts = [region.empty((n,)) for n in (10, 1000, 100000)]
    event = pool.copy_async(list(zip(dsts, srcs)))
    del srcs  # the event keeps them alive until the copy is done
    event.synchronize()
    for n, d in zip((10, 1000, 100000), dsts):
        assert torch.all(d == float(n))


def test_streams_order_work_through_events(pool):
    copy, infer = pool.stream("copy"), pool.stream("infer")
    a = torch.arange(1 << 20, dtype=torch.float32, device=pool.device)
    b = torch.empty_like(a)
    c = torch.empty_like(a)
    copy.copy_async([(b, a)])
    infer.wait(copy.record())
    infer.copy_async([(c, b)]).synchronize()  # runs after the first copy
    assert torch.equal(c, a)


def test_copy_async_rejects_mismatched_pairs(pool):
    a = torch.zeros(10, device=pool.device)
    with pytest.raises(ValueError, match="item 0"):
        pool.copy_async([(a, torch.zeros(11, device=pool.device))])
    with pytest.raises(ValueError, match="contiguous"):
        pool.copy_async([(a, torch.zeros(10, 2, device=pool.device)[:, 0])])
    with pytest.raises(TypeError):
        pool.copy_async([(a,)])


def test_use_makes_a_region_current_and_rejects_unknown_names(pool):
    pool.region("train", budget=16 * MiB)
    with pool.use("train") as region:
        assert region.name == "train"
    with pytest.raises(KeyError, match="no region named"):
        with pool.use("missing"):
            pass


def test_use_refuses_an_asleep_region_by_name(pool):
    """On CUDA torch's MemPool would hand out blocks it cached from the region, unmapped while it
    sleeps; the same code refuses on a host pool."""
    region = pool.region("grads", budget=16 * MiB)
    region.sleep(offload=False)
    with pytest.raises(colo.RegionAsleepError, match="'grads' is asleep"):
        with pool.use("grads"):
            pytest.fail("the block ran on an asleep region")
    region.wake()
    with pool.use("grads") as used:
        assert used is region


def test_region_alignment_is_the_allocation_rounding(pool):
    default = pool.region("weights", budget=16 * MiB)
    wide = pool.region("wide", budget=16 * MiB, alignment=1024)
    assert default.alignment == 256 and wide.alignment == 1024
    a, b = wide.empty((10,), torch.uint8), wide.empty((10,), torch.uint8)
    assert a.data_ptr() % 1024 == 0 and b.data_ptr() - a.data_ptr() == 1024
    with pytest.raises(ValueError, match="power of two of at least 256"):
        pool.region("odd", budget=MiB, alignment=384)
    with pytest.raises(ValueError, match="power of two of at least 256"):
        pool.region("small", budget=MiB, alignment=128)
    with pytest.raises(ValueError, match="at most the pool's granularity"):
        pool.region("huge", budget=MiB, alignment=2 * pool.granularity)


def test_two_threads_allocate_and_free_concurrently(pool):
    region = pool.region("train", budget=512 * MiB)
    errors = []

    def worker(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            live = []
            for _ in range(400):
                if live and torch.rand(1, generator=g).item() < 0.45:
                    t, value = live.pop(int(torch.randint(len(live), (1,), generator=g)))
                    assert torch.all(t == value), "another thread wrote into this block"
                else:
                    n = int(torch.randint(1, 64 * 1024, (1,), generator=g))
                    value = seed * 1000 + len(live)
                    live.append((region.empty((n,), dtype=torch.int32).fill_(value), value))
            for t, value in live:
                assert torch.all(t == value)
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert region.stats()["allocated_bytes"] == 0


def test_memory_taken_outside_the_regions_counts_against_the_capacity(monkeypatch):
    """On CUDA, what torch's caching allocator takes after the pool was made (activations, cached
    blocks) is memory the regions cannot also have; the pool's fit checks leave room for it."""
    from colo.pool import torch_outside_bytes

    assert torch_outside_bytes(reserved_now=5 << 30, reserved_at_start=1 << 30, routed_to_regions=1 << 30) == 3 << 30
    assert torch_outside_bytes(reserved_now=1 << 30, reserved_at_start=2 << 30, routed_to_regions=0) == 0
    pool = colo.Pool("cpu", capacity=64 << 20)
    kv = pool.region("kv", budget=32 << 20)
    kv.sleep()
    monkeypatch.setattr(type(pool), "outside_bytes", property(lambda self: 40 << 20))
    assert pool.unbudgeted_bytes == 24 << 20
    with pytest.raises(colo.OutOfMemoryError, match="outside the regions"):
        kv.wake()
    assert kv.asleep
    with pytest.raises(ValueError, match="outside the regions"):
        pool.region("grads", budget=32 << 20)


def test_wake_first_gives_torchs_cached_blocks_back_then_refuses_only_what_still_does_not_fit(monkeypatch):
    """Freed activations stay in torch's CUDA cache and count as taken; a KV cache waking after
    training (the scheduler's, colo.trl's, a user's wake_kv_cache) must not be refused for them:
    the pool releases torch's cache first (torch.cuda.empty_cache on CUDA) and refuses only what
    still does not fit. Modelled on a host pool: 40 MiB cached, of which 8 MiB stay in use."""
    pool = colo.Pool("cpu", capacity=64 << 20)
    kv = pool.region("kv", budget=32 << 20)
    kv.sleep()
    torch_bytes = {"held": 40 << 20, "in_use": 8 << 20}
    monkeypatch.setattr(type(pool), "outside_bytes", property(lambda self: torch_bytes["held"]))
    monkeypatch.setattr(pool, "_release_torch_cache", lambda: torch_bytes.update(held=torch_bytes["in_use"]))
    kv.wake()
    assert not kv.asleep and torch_bytes["held"] == 8 << 20
    kv.sleep()
    torch_bytes.update(held=40 << 20, in_use=40 << 20)  # all of it live: nothing to give back
    with pytest.raises(colo.OutOfMemoryError, match="outside the regions"):
        kv.wake()
    assert kv.asleep


def test_wake_is_refused_cleanly_when_the_device_itself_is_short(monkeypatch):
    """Memory neither torch nor colo tracks (NCCL buffers, CUDA graphs) can leave a device with less
    free memory than the pool's capacity promises: the wake asks the driver (CUDA; modelled here) and
    refuses with OutOfMemoryError naming it, after giving torch's cache back, instead of failing inside
    the driver's map call; the region stays asleep and wakes once the memory is there."""
    pool = colo.Pool("cpu", capacity=64 << 20)
    kv = pool.region("kv", budget=32 << 20)
    kv.sleep()
    device = {"free": 16 << 20, "released": 0}
    monkeypatch.setattr(pool, "_device_free_bytes", lambda: device["free"])
    monkeypatch.setattr(pool, "_release_torch_cache", lambda: device.update(released=device["released"] + 1))
    with pytest.raises(colo.OutOfMemoryError, match="device has only 16777216 bytes free"):
        kv.wake()
    assert kv.asleep and device["released"] == 1
    device["free"] = 48 << 20
    kv.wake()
    assert not kv.asleep
