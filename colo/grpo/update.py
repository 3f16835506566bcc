"""The optimizer step of a GRPO step, one rule for every kind of views: the gradients made global and
clipped (colo.clipping), then the optimizer's step, the learning rate's schedule and TRL's reference-model
sync, unless the norm is not finite: then the weights the engine serves stay as they were and the next
step starts from zeroed gradients. `Updates` gathers what a step's optimizer steps did for its record.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..clipping import clip_
from . import distributed


@dataclass
class Update:
    """One optimizer step: the gradient norm before clipping, whether it was skipped (a norm that is not
    finite), and the skipped steps in a row up to it."""
    norm: float
    skipped: bool
    skipped_in_a_row: int


class Updater:
    """Clips and steps `optimizer` over `memory`'s gradients (colo.grpo.train_memory.TrainingMemory) the
    same on every rank; `weights_changing` is True from an optimizer step until the engine serves its
    result (a failure then must not checkpoint half-changed weights)."""

    def __init__(self, memory, optimizer, lr_scheduler, *, views, world, config, reference, residency):
        self.memory, self.optimizer, self.lr_scheduler = memory, optimizer, lr_scheduler
        self.views, self.world, self.config, self.reference, self.residency = views, world, config, reference, residency
        self.optimizer_steps = 0   # TRL's global_step: sync_ref_model's clock
        self.skipped_in_a_row = 0  # steps whose gradient norm was not finite, up to the last one
        self.weights_changing = False

    def clip_and_step(self) -> Update:
        self.memory.check_grads_attached()
        norm = global_clipped_norm(self.memory, self.optimizer, self.views, self.world, self.config.max_grad_norm)
        self.residency.sample("train")
        self.memory.finish_prefetch()
        skipped = not math.isfinite(norm)
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if not skipped:
            self.weights_changing = True
            self.optimizer.step()  # sharded: also all-gathers every rank's updated weights into the engine's
            self.memory.adopt_optimizer_state(self.optimizer)  # no-op after the first step
            self.lr_scheduler.step()
        self.optimizer_steps += 1
        cfg = self.config
        if cfg.sync_ref_model and self.optimizer_steps % cfg.ref_model_sync_steps == 0:  # TRL's on_step_end
            self.reference.sync(self.views.trainer_model, cfg.ref_model_mixup_alpha)
        return Update(norm, skipped, self.skipped_in_a_row)


def global_clipped_norm(memory, optimizer, views, world, max_norm: float | None) -> float:
    """Make this rank's accumulated gradients the global ones and clip them (colo.clipping); returns the
    norm before clipping, the same on every rank: not finite means the optimizer must not step.
    Averaged over the data-parallel ranks (with a sharded optimizer, reduce-scattered to their shard's
    rank), the norm the whole model's (a tensor-parallel model's shards counted once: the views')."""
    if memory.shard is not None:  # colo.ShardedMasterWeightOptimizer: reduce-scatter, then the global norm
        return optimizer.clip_grad_norm_(max_norm, weights=views.norm_weights(optimizer.params) or None,
                                         sum_group=views.group)
    distributed.average_(list(memory.flat_grads.values()), world)
    # fp32 parameters keep their gradients in .grad; 16-bit ones the optimizer's fp32 main gradients
    # (colo.MasterWeightOptimizer, over the same parameters in the same order).
    grads = getattr(optimizer, "main_grads", None) or [p.grad for p in memory.params]
    norm = views.grad_norm(memory.params, grads)
    clip_(grads, norm, max_norm)  # not finite: left as they are, and the step must not run
    if hasattr(optimizer, "note_grad_norm"):  # its step() then trusts this norm, not a pass over every gradient
        optimizer.note_grad_norm(norm)
    return norm


class Updates:
    """A step's optimizer steps, each with what its part trained (colo.grpo.strategy.Trained), for the
    record: the first's training figures and norm (TRL's), with several their count and the last's; the
    tensor-parallel all-reduces they took."""

    def __init__(self, views, world):
        self.views, self.world = views, world
        self._started_at = views.collective_count
        self._collectives = 0
        self._steps: list[tuple] = []

    def add(self, trained, update: Update) -> None:
        self._steps.append((trained, update))
        self._collectives = self.views.collective_count - self._started_at

    def fields(self) -> dict:
        (trained, first), (last_trained, last) = self._steps[0], self._steps[-1]
        record = {**trained.fields(self.world), "grad_norm": first.norm, "step_skipped": first.skipped,
                  "skipped_steps_in_a_row": last.skipped_in_a_row}
        if len(self._steps) > 1:
            record.update({"optimizer_steps": len(self._steps), "last_iteration/loss": last_trained.stats["loss"],
                           "last_iteration/clip_fraction": last_trained.stats["clip_fraction"],
                           "last_iteration/grad_norm": last.norm,
                           "last_iteration/step_skipped": any(u.skipped for _, u in self._steps)})
        if self.world.tp_size > 1:
            record["tp_all_reduces"] = self._collectives
        return record
