"""The pool: one per device, carved into named regions that generation and training time-share.

    pool = colo.Pool("cpu")                       # or "cuda", "cuda:0"
    kv = pool.region("kv_cache", budget=8 << 30)
    t = kv.empty((n, m), dtype=torch.bfloat16)    # a torch tensor in region memory (via DLPack)
    kv.sleep(offload=False); kv.wake()            # same addresses after wake
    with pool.use("grads"): ...                   # CUDA: torch's own allocations go to that region

The memory itself lives in the compiled core (csrc/); this module validates arguments, turns
DLPack capsules into tensors and keeps the bookkeeping a Python user needs.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading

import torch

from . import _C
from ._build import cuda_available, cuda_unavailable_reason
from .errors import OutOfMemoryError, RegionAsleepError
from .sizes import shape_bytes

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_STREAM_ROLES = ("train", "infer", "copy")
# torch dtype -> DLPack (type code, bits), so the core hands out tensors of the right dtype in one
# step; other dtypes (complex, float8) come out as bytes and are viewed.
_DLPACK_DTYPES = {
    torch.float16: (2, 16), torch.bfloat16: (4, 16), torch.float32: (2, 32), torch.float64: (2, 64),
    torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32), torch.int64: (0, 64),
    torch.uint8: (1, 8), torch.bool: (6, 8),
}


def _parse_device(device) -> torch.device:
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"colo.Pool: invalid device {device!r} (expected 'cpu', 'cuda' or 'cuda:N')") from e
    else:
        raise TypeError(f"colo.Pool: device must be a str or torch.device, not {type(device).__name__}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"colo.Pool: unsupported device type {dev.type!r} (expected 'cpu' or 'cuda')")
    if dev.type == "cuda":
        if not cuda_available():
            raise ValueError(f"colo.Pool({str(device)!r}): CUDA is unavailable: {cuda_unavailable_reason()}")
        if not torch.backends.cuda.is_built():  # a GPU machine with a CPU-only torch wheel
            raise ValueError(f"colo.Pool({str(device)!r}): the NVIDIA driver is present but torch {torch.__version__} "
                             "was built without CUDA; install a CUDA build of torch")
        # "cuda" is the current device, as everywhere in torch: under torchrun each rank's own.
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    return dev


_MAX_BYTES = 1 << 62  # the core's limit: far above any device, and keeps its rounding from overflowing
_MAX_DIM = (1 << 63) - 1  # DLPack shapes are int64


def _check_bytes(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int number of bytes, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
    if value > _MAX_BYTES:
        raise ValueError(f"{what} of {value} bytes is larger than colo supports (2**62)")
    return value


def _physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Event:
    """A point on a stream; keeps the tensors its copies touch alive until the copies are done."""

    def __init__(self, native, keepalive=()):
        self._native = native
        self._keepalive = list(keepalive)

    def synchronize(self) -> None:
        self._native.synchronize()
        self._keepalive.clear()

    def query(self) -> bool:
        done = self._native.query()
        if done:
            self._keepalive.clear()
        return done


class Stream:
    """An ordered queue of work with a role: 'train', 'infer' or 'copy'.

    'train' and 'infer' run no training or inference: they are ordering points (see `Pool.stream`).
    CUDA: a driver stream with a priority (usable by torch via `torch_stream()`).
    Host: a worker thread, so code that records and waits runs the same on CPU.
    """

    def __init__(self, pool: "Pool", role: str, native):
        self.pool, self.role, self._native = pool, role, native

    def record(self) -> Event:
        return Event(self._native.record())

    def wait(self, event: Event) -> None:
        """Work enqueued on this stream after this call waits for `event`."""
        if not isinstance(event, Event):
            raise TypeError(f"Stream.wait expects a colo.Event, not {type(event).__name__}")
        self._native.wait(event._native)

    def synchronize(self) -> None:
        self._native.synchronize()

    @property
    def native_handle(self) -> int:
        """The CUstream as an int on CUDA; 0 on the host."""
        return self._native.native_handle

    def torch_stream(self):
        """This stream as a torch.cuda.ExternalStream (CUDA pools only)."""
        if self.pool.device.type != "cuda":
            raise RuntimeError("torch_stream() is only available for CUDA pools")
        return torch.cuda.ExternalStream(self.native_handle, device=self.pool.device)

    @contextlib.contextmanager
    def as_current(self):
        """Inside the block torch's current stream of this thread is this one (CUDA; on the host a
        no-op): it first waits for what the thread's stream holds, and the thread's stream waits for it
        on the way out, so the block's work is ordered between theirs and runs at this stream's
        priority. Through torch.cuda.set_stream, which vLLM sees too (it records a thread's stream
        there: vllm.utils.torch_utils); a block inside one on the same stream changes nothing."""
        if self.pool.device.type != "cuda":
            yield
            return
        mine = self.torch_stream()
        previous = torch.cuda.current_stream(self.pool.device)
        if previous == mine:
            yield
            return
        mine.wait_stream(previous)
        torch.cuda.set_stream(mine)
        try:
            yield
        finally:
            previous.wait_stream(mine)
            torch.cuda.set_stream(previous)

    def copy_async(self, pairs) -> Event:
        """Enqueue byte copies [(dst, src), ...] of contiguous tensors as one batch; returns an Event."""
        copies, keep = [], []
        for i, pair in enumerate(pairs):
            try:
                dst, src = pair
            except (TypeError, ValueError) as e:
                raise TypeError(f"copy_async: item {i} must be a (dst, src) pair of tensors") from e
            for what, t in (("dst", dst), ("src", src)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"copy_async: item {i} {what} must be a torch.Tensor, not {type(t).__name__}")
                if not t.is_contiguous():
                    raise ValueError(f"copy_async: item {i} {what} is not contiguous")
            nbytes = dst.nbytes
            if nbytes != src.nbytes:
                raise ValueError(f"copy_async: item {i} copies {src.nbytes} bytes into a {nbytes}-byte destination")
            if nbytes:
                copies.append((dst.data_ptr(), src.data_ptr(), nbytes))
                keep += (dst, src)
        self._native.copy_batch(copies)
        return Event(self._native.record(), keep)


class Region:
    """A named, budgeted part of a pool whose physical memory can sleep and wake at stable addresses."""

    def __init__(self, pool: "Pool", name: str, native):
        self.pool, self.name, self._native = pool, name, native
        self._cuda = pool.device.type == "cuda"

    @property
    def budget(self) -> int:
        return self._native.budget_bytes

    @property
    def asleep(self) -> bool:
        return self._native.asleep

    @property
    def alignment(self) -> int:
        """Bytes every allocation starts at a multiple of and is rounded up to: the bytes after a
        tensor's end up to the next multiple are its own padding, never another allocation's."""
        return self._native.alignment

    @property
    def wakes_zeroed(self) -> bool:
        """Whether memory woken without offload reads as zeros (host pools: yes, fresh pages; CUDA:
        no guarantee), so a caller that wants zeros after wake() need not write them."""
        return self.pool._backend.commits_zeroed

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor in this region; its memory returns to the region when it dies (CUDA:
        once the work queued by then on the stream that was current when it was allocated has run, so
        a kernel still queued never sees it reused; make that stream wait for uses on other streams)."""
        shape = _check_shape(shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Region.empty: dtype must be a torch.dtype, not {type(dtype).__name__}")
        nbytes = shape_bytes(shape, dtype)
        if nbytes > self.budget:  # also keeps absurd sizes away from the core's size_t
            raise OutOfMemoryError(f"region {self.name!r} cannot allocate {nbytes} bytes ({tuple(shape)} of {dtype}): "
                                   f"more than its whole budget of {self.budget} bytes")
        native = _DLPACK_DTYPES.get(dtype)
        if native is not None:
            return torch.from_dlpack(self._allocate_dlpack(nbytes, shape, *native))
        raw = torch.from_dlpack(self._allocate_dlpack(nbytes, (nbytes,), *_DLPACK_DTYPES[torch.uint8]))
        return raw.view(dtype).view(shape)

    def _check_device_has_room(self) -> None:
        """The capacity is a promise among colo's regions and torch; memory neither tracks (NCCL
        buffers, CUDA graph pools, library workspaces) can still leave the device short. Ask the
        driver, so a wake that cannot be mapped is refused here, cleanly, not inside cuMemCreate."""
        free = self.pool._device_free_bytes()
        if free is None or self.budget <= free:
            return
        self.pool._release_torch_cache()
        free = self.pool._device_free_bytes()
        if self.budget > free:
            raise OutOfMemoryError(
                f"region {self.name!r} cannot wake: its budget of {self.budget} bytes fits the pool's capacity, but "
                f"the device has only {free} bytes free (memory outside torch and colo, such as NCCL buffers, "
                f"CUDA graphs and library workspaces, took the rest); lower the region's budget or the pool's capacity")

    def _allocate_dlpack(self, nbytes: int, shape, code: int, bits: int):
        if self._cuda:  # the tensor's free waits for the work queued on this stream (0: legacy default)
            stream = torch.cuda.current_stream(self.pool.device).cuda_stream
            return self._native.allocate_dlpack(nbytes, shape, code, bits, stream)
        return self._native.allocate_dlpack(nbytes, shape, code, bits)

    def zeros(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def sleep(self, offload: bool = False) -> None:
        """Release this region's physical memory. offload=True first copies live bytes to host memory.

        Tensors keep their addresses; without offload their contents are lost. Do not touch them
        until wake(): on the host the pages are inaccessible, on CUDA unmapped.
        """
        if not isinstance(offload, bool):
            raise TypeError(f"Region.sleep: offload must be True or False, not {offload!r}")
        self._native.sleep(offload)

    def wake(self, fault_in: bool = True) -> None:
        """Map fresh physical memory at the same addresses and restore offloaded bytes. With fault_in,
        the memory is faulted in on the region's own copy stream, asynchronously, so first touches after
        wake are cheap; without it (for memory of which the caller uses a small part, such as a KV cache
        sized for full-length sequences), host pages come in where they are first touched, and no thread
        spends the cores on the rest. (CUDA maps physical memory at wake either way.)

        Raises OutOfMemoryError, and stays asleep, when this region's budget does not fit in the
        pool's capacity beside the regions awake now (asleep regions lend their budgets to others),
        or, on CUDA, in what the driver reports free (after torch's cached blocks are given back).
        """
        if not isinstance(fault_in, bool):
            raise TypeError(f"Region.wake: fault_in must be True or False, not {fault_in!r}")
        with self.pool._lock:
            if not self.asleep:
                return
            left = self.pool._awake_headroom(exclude=self)
            if self.budget > left and self.pool.outside_bytes > 0:
                # torch's cached blocks (freed activations) count as taken until torch gives them back.
                self.pool._release_torch_cache()
                left = self.pool._awake_headroom(exclude=self)
            if self.budget > left:
                raise OutOfMemoryError(
                    f"region {self.name!r} cannot wake: its budget of {self.budget} bytes does not fit beside "
                    f"the awake regions ({self.pool._describe_awake(exclude=self)}), which leave {left} of the "
                    f"pool's {self.pool.capacity} bytes; put one of them to sleep first")
            self._check_device_has_room()
            self._native.wake(fault_in)

    def trim(self) -> None:
        """Release committed memory that holds no live allocation."""
        self._native.trim()

    def fit_budget(self) -> int:
        """Shrink the budget to the memory this region holds now (after releasing what no live
        allocation uses), so the rest of the pool's capacity is free for other regions. For a region
        filled once, such as the engine's weights after loading; returns the new budget."""
        with self.pool._lock:
            self.trim()
            s = self.stats()
            self._native.set_budget(max(s["committed_bytes"], s["allocated_bytes"], 1))
            return self.budget

    def grow_budget(self) -> int:
        """Raise the budget to all the pool has left beside the awake regions (at most the address
        range reserved when the region was made), e.g. before refilling a fitted region; returns it."""
        with self.pool._lock:
            left = self.pool._awake_headroom(exclude=self)
            self._native.set_budget(min(max(self.budget, left), self._native.stats()["virtual_bytes"]))
            return self.budget

    def stats(self) -> dict:
        """allocated_bytes, committed_bytes, resident_bytes, peak_allocated_bytes, budget_bytes, asleep, ..."""
        return dict(self._native.stats())

    def contains(self, tensor: torch.Tensor) -> bool:
        return self._native.contains(tensor.data_ptr())

    def __repr__(self) -> str:
        s = self.stats()
        state = "asleep" if s["asleep"] else "awake"
        return (f"Region({self.name!r}, {state}, allocated={s['allocated_bytes']}, "
                f"resident={s['resident_bytes']}, budget={s['budget_bytes']})")


def _check_shape(shape) -> tuple[int, ...]:
    if type(shape) is tuple and all(type(n) is int and 0 <= n <= _MAX_DIM for n in shape):
        return shape  # the common case, checked cheaply
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be an int or a tuple of ints, not {type(shape).__name__}")
    for n in shape:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"shape entries must be ints, got {n!r} in {tuple(shape)}")
        if n < 0 or n > _MAX_DIM:
            raise ValueError(f"shape entries must be in [0, 2**63), got {tuple(shape)}")
    return tuple(shape)


def _check_awake_for_use(region: Region) -> None:
    if region.asleep:
        raise RegionAsleepError(f"pool.use({region.name!r}): region {region.name!r} is asleep; wake() it first "
                                "(torch's MemPool would hand out blocks of it whose memory is released)")


def _check_alignment(alignment, name: str, granularity: int) -> None:
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        raise TypeError(f"region {name!r} alignment must be an int number of bytes, not {type(alignment).__name__}")
    if alignment < 256 or alignment & (alignment - 1) or alignment > granularity:
        raise ValueError(f"region {name!r} alignment must be a power of two of at least 256 bytes and at most "
                         f"the pool's granularity ({granularity}), got {alignment}")


def torch_outside_bytes(reserved_now: int, reserved_at_start: int, routed_to_regions: int) -> int:
    """What torch's CUDA caching allocator holds beyond what it held when a pool was made, less the
    segments it took from colo's regions through MemPools (those are the regions' own bytes)."""
    return max(0, reserved_now - reserved_at_start - routed_to_regions)


class Pool:
    """One memory pool per device, carved into named regions.

    capacity: the bytes the budgets of the regions *awake at the same time* may add up to (default:
    physical memory on the host, free device memory at creation on CUDA). Regions time-share it: an
    asleep region's budget is free for others (the KV cache can use the gradients' bytes during
    generation), and waking is refused while the region would not fit. A region created without
    a budget gets what the awake ones leave, so nobody tunes a memory-utilisation fraction by hand.
    host_backend: 'anon' (default, transparent huge pages, fast release) or 'memfd'.
    """

    def __init__(self, device="cpu", *, capacity: int | None = None, host_backend: str = "anon"):
        self.device = _parse_device(device)
        if not isinstance(host_backend, str):
            raise TypeError("host_backend must be 'anon' or 'memfd'")
        if self.device.type == "cuda":
            self._backend = _C.make_cuda_backend(self.device.index)
            default_capacity = torch.cuda.mem_get_info(self.device)[0] if capacity is None else None
            self._torch_reserved_at_start = torch.cuda.memory_reserved(self.device)
        else:
            self._backend = _C.make_host_backend(host_backend)
            default_capacity = _physical_memory_bytes() if capacity is None else None
        self.capacity = _check_bytes(capacity if capacity is not None else default_capacity, "Pool capacity")
        self._regions: dict[str, Region] = {}
        self._streams: dict[str, Stream] = {}
        self._torch_pools: dict[str, object] = {}
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def granularity(self) -> int:
        """Bytes in which physical memory is committed and released; a region's committed memory never
        exceeds its budget rounded up to this."""
        return self._backend.granularity

    @property
    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    @property
    def unbudgeted_bytes(self) -> int:
        """Capacity not promised to an awake region: what a new region, or one waking, may have."""
        return self._awake_headroom()

    @property
    def outside_bytes(self) -> int:
        """Memory this pool's device gave others since the pool was made, which its capacity must
        leave room for: on CUDA what torch's caching allocator took outside colo's regions
        (activations, the trainer's temporaries, its cached blocks); 0 on the host, where the
        capacity is a plain promise about RAM (the OS accounts for everything else)."""
        if self.device.type != "cuda":
            return 0
        routed = sum(self._regions[name].stats()["allocated_bytes"] for name in self._torch_pools)
        return torch_outside_bytes(torch.cuda.memory_reserved(self.device), self._torch_reserved_at_start, routed)

    def _device_free_bytes(self) -> int | None:
        """What the driver says is free on the device now (None on the host, where the OS decides)."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def _release_torch_cache(self) -> None:
        """Hand torch's cached but unused device blocks back to the driver (CUDA; nothing on the host)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _awake_headroom(self, exclude: Region | None = None) -> int:
        awake = sum(r.budget for r in self._regions.values() if r is not exclude and not r.asleep)
        return self.capacity - awake - self.outside_bytes

    def _describe_awake(self, exclude: Region | None = None) -> str:
        awake = [f"{r.name}={r.budget}" for r in self._regions.values() if r is not exclude and not r.asleep]
        outside = self.outside_bytes
        return ", ".join(awake + ([f"outside the regions={outside}"] if outside else [])) or "none"

    def region(self, name: str, budget: int | None = None, *, chunk_bytes: int | None = None,
               alignment: int = 256) -> Region:
        """The region called `name`, created on first use with `budget` bytes (None: what is left).

        chunk_bytes: the unit physical memory is committed in (None: the backend's default; rounded
        up to the granularity). alignment: every allocation starts at a multiple of it and is rounded
        up to one (a power of two from 256 bytes to the granularity)."""
        if not isinstance(name, str):
            raise TypeError(f"region name must be a str, not {type(name).__name__}")
        if not _NAME.match(name):
            raise ValueError(f"invalid region name {name!r}: use letters, digits, '_', '.', '-' (max 64), "
                             "starting with a letter or '_'")
        with self._lock:
            if name in self._regions:
                existing = self._regions[name]
                if budget is not None and budget != existing.budget:
                    raise ValueError(f"region {name!r} already exists with a budget of {existing.budget} bytes")
                return existing
            left = self.unbudgeted_bytes
            if budget is None:
                if left <= 0:
                    raise OutOfMemoryError(f"region {name!r}: nothing left of the pool's {self.capacity}-byte capacity")
                budget = left
            budget = _check_bytes(budget, f"region {name!r} budget")
            if budget > left:
                raise ValueError(f"region {name!r} budget of {budget} bytes exceeds what the pool has left "
                                 f"({left} of {self.capacity} bytes beside the awake regions: "
                                 f"{self._describe_awake()}; asleep ones lend theirs)")
            chunk = 0 if chunk_bytes is None else _check_bytes(chunk_bytes, "chunk_bytes")
            _check_alignment(alignment, name, self.granularity)
            region = Region(self, name, _C.Region(self._backend, name, budget, chunk, alignment))
            self._regions[name] = region
            return region

    def stream(self, role: str) -> Stream:
        """The pool's stream for the role 'train', 'infer' or 'copy'.

        'train' and 'infer' run no training or inference themselves; they are ordering points:
        `SharedWeights.publish()` records an event on 'train' after the trainer's work (torch's
        current stream) and makes 'infer' wait for it, and the engine's work waits for 'infer', so
        it runs after the trainer's. 'copy' carries the pool's copies (weight copies and casts at
        publish, the optimizer state's offload); each region sleeps and wakes on a copy stream of its own.
        On CUDA 'train' has the lowest priority and the other two the highest.
        """
        if role not in _STREAM_ROLES:
            raise ValueError(f"unknown stream role {role!r} (expected one of {_STREAM_ROLES})")
        with self._lock:
            if role not in self._streams:
                self._streams[role] = Stream(self, role, self._backend.create_stream(role))
            return self._streams[role]

    def copy_async(self, pairs, stream: str = "copy") -> Event:
        """Batched byte copies [(dst, src), ...] on one of the pool's streams; returns an Event."""
        return self.stream(stream).copy_async(pairs)

    def stats(self) -> dict[str, dict]:
        return {name: r.stats() for name, r in self._regions.items()}

    @contextlib.contextmanager
    def use(self, name: str):
        """Route torch's own allocations made inside the block to region `name`; yields the region.

        CUDA: through torch.cuda.MemPool + a CUDAPluggableAllocator loading colo's C entry points,
        which allocate in the core's current region of the device (torch routes the current thread
        only: autograd's backward threads are not routed; expandable_segments must be off). The core's
        current region is one per device, not per thread: two threads inside `use` blocks of
        different regions on one device both allocate in whichever entered last. CPU: torch's CPU
        allocator cannot be replaced per block, so the block runs unchanged (torch allocations stay
        where they were); it is accepted so that code written for both devices runs on a host pool.

        Raises RegionAsleepError for an asleep region, on every device (the same code runs on both):
        torch's MemPool hands out blocks it cached from the region's earlier segments without asking
        colo, and while the region sleeps those addresses are unmapped. For the same reason, do not
        put the region to sleep inside the block.
        """
        region = self._regions.get(name)
        if region is None:
            raise KeyError(f"no region named {name!r} in this pool (have: {sorted(self._regions)})")
        _check_awake_for_use(region)
        if self.device.type != "cuda":
            yield region
            return
        previous = _C.current_region(self.device.index)
        _C.set_current_region(self.device.index, region._native)
        try:
            with torch.cuda.use_mem_pool(self._torch_pool(name), device=self.device):
                yield region
        finally:
            _C.set_current_region(self.device.index, previous)

    def _torch_pool(self, name: str):
        if name not in self._torch_pools:
            allocator = torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, "colo_torch_alloc", "colo_torch_free")
            # The MemPool holds only the raw allocator; the Python object owns the loaded entry points,
            # so it lives as long as the MemPool does.
            self._torch_pools[name] = (allocator, torch.cuda.MemPool(allocator.allocator()))
        return self._torch_pools[name][1]

    def __repr__(self) -> str:
        return f"Pool({str(self.device)!r}, backend={self.backend!r}, regions={list(self._regions)})"
