"""colo's exceptions. The compiled core raises these by name (see csrc/bindings.cpp)."""


class OutOfMemoryError(MemoryError):
    """A request does not fit the region's budget or free space, or the device has no memory left.

    The message names the region, the request, what is allocated and free, and the budget.
    A refused request changes nothing.
    """


class RegionAsleepError(RuntimeError):
    """Allocation in a region whose physical memory is released; call `region.wake()` first."""
