"""The memory phases of a GRPO step: one object, two verbs, in torch_memory_saver's manner.

    phases.to_train()      KV cache released; gradients awake and zeroed; the optimizer state (where
                           it was offloaded) coming back on the copy stream while forward and backward run
    phases.to_generate()   gradients released; the optimizer state copied out to host where it is
                           offloaded; KV cache awake. A step splits it around the publish, which
                           overlaps the copy out: to_generate_begin(); publish; to_generate_end()

Between steps a run is ready to generate. Each verb does only what is not in place already (a
no-op when called twice), and times itself: `take_seconds()` is the step's phase_switch_s. With
memory phases off (config.memory_phases False) nothing sleeps: to_train() only zeroes the gradients.

The order matters and lives here: the gradients are released before the optimizer state's copy
out starts (releasing device memory waits for all queued work, CUDA unmaps synchronise, which must not
include the copy that is meant to overlap the publish); the copy out ends before the KV cache wakes
into the bytes it frees; a GPU's cached activation blocks go back before then too.
"""
from __future__ import annotations

import contextlib
import time

import torch


class MemoryPhases:
    """The phases of `memory` (colo.grpo.train_memory.TrainingMemory) and of `engine`'s KV cache
    (colo.grpo.rollout_engine.RolloutEngine); on: whether anything sleeps (config.memory_phases)."""

    def __init__(self, engine, memory, *, on: bool):
        self.engine, self.memory, self.on = engine, memory, on
        self._seconds = 0.0

    def to_train(self, *, gradients_awake: bool = False) -> None:
        """KV cache asleep; gradients awake, zeroed (unless `gradients_awake`: they already hold the
        groups an overlapped step trained while generating); optimizer state on its way back."""
        started = time.perf_counter()
        if self.on:
            self.engine.sleep_kv_cache()
        if not gradients_awake:
            self.memory.wake_gradients()
        self.memory.start_prefetch()  # finish_prefetch() waits for it right before the optimizer steps
        self._seconds += time.perf_counter() - started

    def to_generate(self) -> None:
        """Gradients asleep, optimizer state copied out where offloaded, KV cache awake."""
        self.to_generate_begin()
        self.to_generate_end()

    def to_generate_begin(self) -> None:
        """Gradients asleep; the optimizer state's copy out started where offloaded. What runs before
        to_generate_end() (a step's publish) overlaps the copy."""
        started = time.perf_counter()
        if self.on:
            if self.memory.pool.device.type == "cuda":
                torch.cuda.empty_cache()  # activations' cached blocks go back before the KV cache wakes
            if not self.memory.grads.asleep:
                self.memory.grads.sleep(offload=False)  # dead between steps
            self.memory.start_offload()
        self._seconds += time.perf_counter() - started

    def to_generate_end(self) -> None:
        """The optimizer state's copy out finished; KV cache awake (into the bytes the copy freed)."""
        started = time.perf_counter()
        self.memory.finish_offload()
        if self.on and self.engine.kv_cache_asleep:
            self.engine.wake_kv_cache()  # also forgets prefixes whose KV was lost
        self._seconds += time.perf_counter() - started

    def wake_gradients_for_overlap(self) -> None:
        """Gradients awake and zeroed beside the awake KV cache: groups train while the engine generates."""
        self.memory.wake_gradients()

    def drop_gradients(self) -> None:
        """What groups trained during a failed generation accumulated is void: the gradients sleep
        (a retry starts from zeroed ones)."""
        if not self.memory.grads.asleep:
            self.memory.grads.sleep(offload=False)

    @property
    def kv_cache_awake(self) -> bool:
        """Whether the KV cache holds its memory now (with phases off it always does)."""
        return not self.engine.kv_cache_asleep

    def take_seconds(self) -> float:
        """The seconds the switches took since the last call."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    @contextlib.contextmanager
    def optimizer_state_in_reach(self):
        """Between steps: the optimizer state in its region for the block (a checkpoint reads or
        restores it), and back where it was after. If its budget does not fit beside the awake KV cache
        (they time-share the pool), the KV cache sleeps for the block; its contents are disposable
        between steps, and it wakes again after."""
        memory = self.memory
        away = memory.optimizer_state_away
        kv_slept = False
        if away:
            region = memory.optimizer_region
            if region.asleep and region.budget > memory.pool.unbudgeted_bytes and not self.engine.kv_cache_asleep:
                self.engine.sleep_kv_cache()
                kv_slept = True
            memory.finish_prefetch()  # wakes and copies back
        try:
            yield
        finally:
            if away:
                memory.offload_optimizer_state()
            if kv_slept:
                self.engine.wake_kv_cache()
