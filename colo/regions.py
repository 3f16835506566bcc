"""The pool regions colo itself creates, by name, and how a region's budget is sized.

Any other name is the caller's own (a benchmark's scratch region, a user's).
"""
from __future__ import annotations

from .sizes import round_up

WEIGHTS = "weights"      # the engine's parameters; a trainer that shares them holds views of them
KV_CACHE = "kv_cache"    # the engine's KV cache; asleep while the trainer trains
GRADS = "grads"          # the trainer's gradients (colo.grpo); asleep while the engine generates
OPTIMIZER = "optimizer"  # optimizer state and fp32 master weights (colo.grpo); offloaded while generating

# The unit the weights region commits physical memory in (rounded up to the pool's granularity). The
# region is made with all the pool has left as its budget, where the core's default chunk on CUDA is
# 1/64 of the budget: ~1.2 GB on an 80 GB GPU, all of it kept committed by fit_budget() for a model
# of a few MB, and then missing for the KV cache. Weights are committed once, at load, so small
# chunks cost little: one cuMemCreate + cuMemMap per 2 MiB, about 8,000 for a 16 GB model. The
# fitted region then commits the weights plus the unused tails of the chunks they end in (under
# 2 MiB for a model loaded as one run).
WEIGHTS_CHUNK_BYTES = 2 << 20


def region_for(pool, name: str, nbytes: int):
    """The pool's region `name`; created on first use with a budget of `nbytes` rounded up to the
    pool's granularity (at least one unit), the unit in which the region commits memory, so the
    budget the pool accounts for is what the region really holds."""
    region = pool.regions.get(name)
    if region is None:
        granularity = pool.granularity
        region = pool.region(name, budget=max(granularity, round_up(nbytes, granularity)))
    return region
