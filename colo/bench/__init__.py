"""colo's microbenchmarks: `python -m colo.bench`.

Each section is a module `colo.bench.<section>` with `run(quick, progress) -> list[dict]`
(docs/CONTRACTS.md). Every figure is measured beside the baseline a user would otherwise use,
in the same run, and reported with the ratio baseline_s / colo_s (>1 means colo is faster).

Nothing heavy is imported here, so `python -m colo.bench --help` stays instant.
"""

# In the order they run; the cheap pool sections first so their rows appear early.
SECTIONS = ("pool_alloc", "sleep_wake", "publish", "grpo_step", "memory", "trl", "lora", "logprob_memory", "overlap")

DEVICE_CHOICES = ("cpu", "cuda", "all")

__all__ = ["SECTIONS", "DEVICE_CHOICES"]
