"""The pool regions colo itself creates, by name, and how a region's budget is sized.

Any other name is the caller's own (a benchmark's scratch region, a user's).
"""
from __future__ import annotations

from .sizes import round_up

WEIGHTS = "weights"      # the engine's parameters; a trainer that shares them holds views of them
KV_CACHE = "kv_cache"    # the engine's KV cache; asleep while the trainer trains
GRADS = "grads"          # the trainer's gradients (colo.grpo); asleep while the engine generates
OPTIMIZER = "optimizer"  # optimizer state and fp32 master weights (colo.grpo); offloaded while generating


def region_for(pool, name: str, nbytes: int):
    """The pool's region `name`; created on first use with a budget of `nbytes` rounded up to the
    pool's granularity (at least one unit), the unit in which the region commits memory, so the
    budget the pool accounts for is what the region really holds."""
    region = pool.regions.get(name)
    if region is None:
        granularity = pool.granularity
        region = pool.region(name, budget=max(granularity, round_up(nbytes, granularity)))
    return region
