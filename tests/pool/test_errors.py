"""One error family: everything colo raises of its own derives from colo.ColoError and from the
builtin it refines, so `except MemoryError` and `except colo.ColoError` both catch it."""
from __future__ import annotations

import pytest

import colo


@pytest.mark.parametrize("name,builtin", [("OutOfMemoryError", MemoryError), ("RegionAsleepError", RuntimeError),
                                          ("EngineFailure", RuntimeError), ("CheckpointError", ValueError),
                                          ("Terminated", Exception)])
def test_exported_errors_are_colo_errors(name, builtin):
    error = getattr(colo, name)
    assert issubclass(error, colo.ColoError) and issubclass(error, builtin) and name in colo.__all__


def test_the_grpo_modules_raise_the_same_classes():
    from colo.grpo import CheckpointError, EngineFailure
    from colo.grpo.scheduler import Terminated

    assert (CheckpointError, EngineFailure, Terminated) == (colo.CheckpointError, colo.EngineFailure, colo.Terminated)


def test_the_compiled_core_raises_colo_errors():
    pool = colo.Pool("cpu", capacity=8 << 20)
    region = pool.region("weights", budget=4 << 20)
    with pytest.raises(colo.ColoError, match="weights"):
        region.empty((64 << 20,), dtype=__import__("torch").uint8)
    region.sleep(offload=False)
    with pytest.raises(colo.RegionAsleepError):
        region.empty((16,))
