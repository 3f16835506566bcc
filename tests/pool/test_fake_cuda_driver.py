"""colo's Python layer on a machine where a CUDA driver answers, using the host-memory stand-in
libcuda.so.1 of csrc/tests/fake_cuda_driver.cpp (built here with CMake; LD_LIBRARY_PATH points the
extension's dlopen at it in a subprocess). What it shows without a GPU: build_info and the probe
report the driver, a `cuda` pool with a CPU-only torch is a clear error, and the compiled CUDA VMM
backend allocates, sleeps (device memory released), wakes at the same addresses and restores
offloaded bytes through the bindings, wakes a large region in few driver calls, and keeps a dropped
tensor's memory from reuse while work on its stream is queued. The C++ core tests run the same
backend under ASan in CI.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import colo
from helpers.cmake_driver import load_cmake_build

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fake_driver_dir(tmp_path_factory) -> Path:
    if not colo.build_info()["cuda_compiled"]:
        pytest.skip("colo was built without the CUDA backend (no CUDA toolkit): nothing to drive")
    build = tmp_path_factory.mktemp("fake-cuda-build")
    cmake_build = load_cmake_build()
    # cuda.h from where colo's own build took it (a toolkit, or torch's NVIDIA runtime wheel).
    cmake_build.configure(ROOT, build, ["-DCOLO_BUILD_PYTHON=OFF", "-DCOLO_BUILD_TESTS=ON", "-DCMAKE_BUILD_TYPE=Release",
                                        *cmake_build.cuda_plan_for_this_python().cmake_args()])
    cmake_build.build(build, target="colo_fake_cuda")
    assert (build / "fake_cuda" / "libcuda.so.1").exists()
    return build / "fake_cuda"


# Prepended to every script: driver_calls(name), the fake driver's count of calls to an entry point
# (the library loaded here is the one colo's dlopen then finds).
DRIVER_CALLS = """
import ctypes
_fake = ctypes.CDLL("libcuda.so.1")
_fake.colo_fake_cuda_call_count.restype = ctypes.c_size_t
_fake.colo_fake_cuda_call_count.argtypes = [ctypes.c_char_p]
def driver_calls(name):
    return _fake.colo_fake_cuda_call_count(name.encode())
"""


def run_with_fake_driver(fake_driver_dir: Path, script: str, device_memory: int = 256 << 20) -> str:
    env = {**os.environ, "LD_LIBRARY_PATH": f"{fake_driver_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "COLO_FAKE_CUDA_DEVICES": "2", "COLO_FAKE_CUDA_MEMORY": str(device_memory)}
    done = subprocess.run([sys.executable, "-c", DRIVER_CALLS + textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_probe_and_build_info_report_the_driver(fake_driver_dir):
    out = run_with_fake_driver(fake_driver_dir, """
        import colo
        info = colo.build_info()
        assert info["cuda_available"] and colo.cuda_available(), info
        assert info["cuda_unavailable_reason"] == "" and colo.cuda_unavailable_reason() == ""
        assert info["cuda_device_count"] == 2 and info["cuda_driver_version"] > 0, info
        print("probe ok")
    """)
    assert "probe ok" in out


def test_cuda_pool_with_a_cpu_only_torch_is_a_clear_error(fake_driver_dir):
    # The install's torch is PyPI's CUDA build: a CPU-only one is what torch.backends.cuda.is_built says
    # (the one thing colo reads of the build), so the child says it.
    out = run_with_fake_driver(fake_driver_dir, """
        import torch
        torch.backends.cuda.is_built = lambda: False
        import colo
        try:
            colo.Pool("cuda")
        except ValueError as e:
            assert "built without CUDA" in str(e) and "driver is present" in str(e), e
            print("refused:", e)
        else:
            raise AssertionError("colo.Pool('cuda') accepted a CPU-only torch")
    """)
    assert "refused:" in out


def test_cuda_vmm_backend_through_the_bindings(fake_driver_dir):
    out = run_with_fake_driver(fake_driver_dir, """
        import ctypes
        from colo import _C

        backend = _C.make_cuda_backend(1)
        try:
            _C.make_cuda_backend(2)
        except ValueError as e:
            assert "out of range" in str(e), e
        else:
            raise AssertionError("device 2 of 2 accepted")

        region = _C.Region(backend, "kv_cache", 96 << 20)
        blocks = [region.allocate(8 << 20) for _ in range(6)]
        for i, p in enumerate(blocks):
            ctypes.memset(p, i + 1, 8 << 20)          # fake device memory is host-readable
        stats = region.stats()
        assert stats["resident_bytes"] >= 48 << 20, stats

        region.sleep(True)                             # offload to pinned host memory, release
        assert region.stats()["resident_bytes"] == 0
        region.free(blocks.pop())                      # freed while asleep: not restored
        region.wake()
        assert region.stats()["resident_bytes"] > 0
        for i, p in enumerate(blocks):                 # same addresses, same bytes
            assert ctypes.string_at(p + 12345, 4) == bytes([i + 1]) * 4

        try:
            region.allocate(200 << 20)                 # over the region's budget
        except MemoryError as e:
            assert "kv_cache" in str(e), e
        else:
            raise AssertionError("over-budget allocation accepted")
        big = _C.Region(backend, "train", 1 << 30)    # budget above the 256 MiB device
        try:
            big.allocate(512 << 20)
        except MemoryError as e:
            assert "no physical memory left" in str(e), e
        else:
            raise AssertionError("allocation beyond the device's memory accepted")
        assert big.stats()["allocated_bytes"] == 0 and big.stats()["resident_bytes"] == 0
        print("vmm ok")
    """)
    assert "vmm ok" in out


def test_a_large_region_wakes_in_few_driver_calls(fake_driver_dir):
    # A 40 GiB KV cache on a 48 GiB fake device (its memory is host memory only where written, and
    # nothing is): a chunk per 1/64 of the region, one cuMemCreate each, one cuMemSetAccess per wake.
    out = run_with_fake_driver(fake_driver_dir, """
        from colo import _C

        region = _C.Region(_C.make_cuda_backend(0), "kv_cache", 40 << 30)
        stats = region.stats()
        chunks = -(-stats["virtual_bytes"] // stats["chunk_bytes"])
        assert chunks <= 64, stats
        kv = region.allocate(40 << 30)
        region.sleep(False)
        creates, accesses = driver_calls("cuMemCreate"), driver_calls("cuMemSetAccess")
        region.wake()
        assert driver_calls("cuMemCreate") - creates == chunks, (driver_calls("cuMemCreate") - creates, chunks)
        assert driver_calls("cuMemSetAccess") - accesses == 1, driver_calls("cuMemSetAccess") - accesses
        region.free(kv)
        print("wake calls ok:", chunks, "chunks")
    """, device_memory=48 << 30)
    assert "wake calls ok: 64 chunks" in out


def test_a_tensor_freed_with_work_queued_on_its_stream_is_not_reused_until_that_work_ran(fake_driver_dir):
    # The DLPack deleter (what runs when torch drops a region tensor) frees in order with the
    # tensor's stream; the fake driver holds that stream's work back, as a busy GPU would.
    out = run_with_fake_driver(fake_driver_dir, """
        import ctypes
        from colo import _C

        _fake.colo_fake_cuda_hold_stream.argtypes = [ctypes.c_void_p, ctypes.c_int]
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]

        def data_ptr(capsule):  # DLManagedTensor starts with DLTensor, which starts with `data`
            return ctypes.c_void_p.from_address(get_pointer(capsule, b"dltensor")).value

        backend = _C.make_cuda_backend(0)
        torch_stream = backend.create_stream("train")  # stands in for torch.cuda.current_stream()
        half = 4 << 20
        for stream in (torch_stream.native_handle, 0):  # 0: the legacy default stream
            region = _C.Region(backend, "kv_cache", 2 * half)
            tensor = region.allocate_dlpack(half, [half], 1, 8, stream)
            a = data_ptr(tensor)
            _fake.colo_fake_cuda_hold_stream(stream, 1)  # a kernel using the tensor is still queued
            del tensor
            assert region.stats()["pending_free_bytes"] == half, region.stats()
            b = region.allocate(half)
            assert b != a, "a block was handed out again while work on its stream was queued"
            region.free(b)
            backend.synchronize_device()  # the device catches up
            c = region.allocate(1 << 20)
            assert c == a and region.stats()["pending_free_bytes"] == 0, (hex(a), hex(c), region.stats())
            region.free(c)
            _fake.colo_fake_cuda_hold_stream(stream, 0)

        # Without a stream (host pools, and the default), a dropped tensor's memory is reusable at once.
        region = _C.Region(backend, "weights", half)
        tensor = region.allocate_dlpack(half, [half], 1, 8)
        a = data_ptr(tensor)
        del tensor
        assert region.stats()["pending_free_bytes"] == 0 and region.allocate(half) == a

        # colo.Region of a CUDA pool hands the core torch's current stream. torch here is a CPU build:
        # the pool is a stand-in, current_stream a stub, and the capsule never becomes a tensor.
        import types
        import torch
        import colo.pool

        pool = types.SimpleNamespace(device=torch.device("cuda", 0))
        torch.cuda.current_stream = lambda device: types.SimpleNamespace(cuda_stream=torch_stream.native_handle)
        native = _C.Region(backend, "kv_cache", half)
        tensor = colo.pool.Region(pool, "kv_cache", native)._allocate_dlpack(half, (half,), 1, 8)
        _fake.colo_fake_cuda_hold_stream(torch_stream.native_handle, 1)
        del tensor
        assert native.stats()["pending_free_bytes"] == half, native.stats()
        backend.synchronize_device()
        assert native.allocate(half) and native.stats()["pending_free_bytes"] == 0
        print("ordered frees ok")
    """)
    assert "ordered frees ok" in out


def test_the_engine_weights_region_commits_in_chunks_sized_for_weights(fake_driver_dir):
    # The weights region's budget is all the pool has left (40 GiB here); the core's default CUDA
    # chunk for that is 1/64 of it, 640 MiB, which a fitted budget then keeps committed for a 1 MB
    # model. colo's engine placement asks for chunks sized for weights instead.
    out = run_with_fake_driver(fake_driver_dir, """
        import colo
        from colo import _C
        from colo.vllm_compat import EnginePlacement

        # torch here is a CPU build, so colo.Pool("cuda") is refused: a pool whose backend is the fake
        # driver's device stands in (the backend alone decides chunks and commits; nothing becomes a tensor).
        pool = colo.Pool("cpu", capacity=40 << 30)
        pool._backend = _C.make_cuda_backend(0)
        region = EnginePlacement(pool).weights_region()
        assert region.budget == 40 << 30, region.budget
        chunk = region.stats()["chunk_bytes"]
        assert chunk <= 32 << 20, chunk
        model = [region._native.allocate(n) for n in (300 << 10, 700 << 10, 24 << 10)]  # a ~1 MB model
        scratch = region._native.allocate(64 << 20)  # load-time scratch, freed before the budget is fitted
        region._native.free(scratch)
        region.fit_budget()
        committed = region.stats()["committed_bytes"]
        assert 0 < committed <= -(-(1 << 20) // chunk) * chunk, (committed, chunk)
        assert region.budget == committed
        print("weights chunks ok:", chunk, committed)
    """, device_memory=48 << 30)
    assert "weights chunks ok: 2097152 2097152" in out
