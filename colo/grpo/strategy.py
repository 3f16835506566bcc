"""Serial or overlapped: how a step generates its rollout, scores it and trains on it. The scheduler
chooses one per run (colo.grpo.overlap.serial_reason says why a run is serial) and calls the same
three methods either way:

    generated = strategy.generate(step, rows, prompts, sampling)   # one try (the scheduler retries)
    scores, reward_s = strategy.score(step, rollout, generated)
    rollout, scores, counts = strategy.informative(step, rollout, scores, generated)  # dynamic_sampling only
    trained = strategy.train(rollout, scores, generated)           # forward, loss, backward

Both train through the trainer they are given (colo.grpo.backward.PolicyTrainer: the views' model, the
reference, the memory sampled while activations are alive), not through the scheduler.

`SerialSteps` generates the whole batch, then scores it, then trains on it. `OverlappedSteps` scores
and trains each prompt's group as soon as its completions are done, while the engine decodes the
others (colo.grpo.overlap); a step whose gradients do not fit beside the KV cache that moment, or that
runs out of memory while training during generation, is generated again serially, and says why.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from . import distributed, dynamic_sampling
from .batch import concatenated_scores, loss_tokens
from .advantages import advantages_of
from .overlap import GroupFailed, OverlappedStep, finish_overlap, memory_refusal, start_overlapped_step
from .rollout_engine import GenerationTrace

logger = logging.getLogger(__name__)


@dataclass
class Generated:
    """One generation's outputs: the completions (n per prompt, prompt after prompt), the overlapped
    step that scored and trained groups while generating (None: serial), the tail's seconds (fewer than
    a quarter of the sequences still decoding), and why an overlapped run generated this step serially."""
    completions: list
    overlapped: OverlappedStep | None = None
    tail_s: float = 0.0
    fallback: str | None = None
    engine_step_s: float = 0.0   # the median engine step's seconds (colo.grpo.rollout_engine.GenerationTrace)


@dataclass
class Trained:
    """What forward, loss and backward over a rollout report (colo.grpo.backward.merge_stats), and,
    for an overlapped step, the trainer's seconds while the engine decoded and the groups trained then."""
    stats: dict
    during_generation: dict = field(default_factory=dict)   # overlap_train_s, groups_trained_during_generation


class SerialSteps:
    """Generate everything, then score, then train: `trainer` (colo.grpo.backward.PolicyTrainer) runs
    forward, loss and backward over the completions."""

    overlapped = False

    def __init__(self, engine, task, config, world, trainer, agent=None):
        self.engine, self.task, self.config, self.world, self.trainer = engine, task, config, world, trainer
        self.agent = agent  # multi-turn rollouts (colo.grpo.agent), or None: one engine call, one turn

    @property
    def generating(self) -> bool:
        """True while the engine decodes (memory sampled then counts as generation's)."""
        return self.trainer.generating

    @generating.setter
    def generating(self, value: bool) -> None:
        self.trainer.generating = value

    def generate(self, step: int, rows, prompts, sampling) -> Generated:
        trace = GenerationTrace()
        self.generating = True
        try:
            completions = self._rollouts(rows, prompts, sampling, trace=trace)
        finally:
            self.generating = False
        return Generated(completions, tail_s=trace.tail_s, engine_step_s=trace.median_step_s)

    def _rollouts(self, rows, prompts, sampling, **options) -> list:
        if self.agent is not None:
            return self.agent.generate(rows, prompts, sampling, **options)
        return self.engine.generate(prompts, sampling, **options)

    def score(self, step: int, rollout, generated: Generated):
        """(colo.grpo.task.Scores of every completion, the seconds the reward functions took)."""
        started = time.perf_counter()
        scores = self.task.score(step, rollout.rows, rollout.prompts, rollout.completions, **rollout.reward_inputs())
        return scores, time.perf_counter() - started

    def informative(self, step: int, rollout, scores, generated: Generated):
        """Dynamic sampling: (the rollout the step trains on, its scores, the record's counts); the
        groups whose rewards are all equal replaced by new prompts' (colo.grpo.dynamic_sampling)."""
        def generate(rows, prompts, sampling):
            return SerialSteps.generate(self, step, rows, prompts, sampling).completions

        return dynamic_sampling.fill_with_informative_groups(
            step, rollout, scores, task=self.task, config=self.config, world=self.world, engine=self.engine,
            generate=generate,
            score=lambda more: SerialSteps.score(self, step, more, None)[0])

    def advantages(self, scores, rollout) -> torch.Tensor:
        """Each completion's advantage (colo.grpo.advantages; a collective where it needs the batch's statistics)."""
        return advantages_of(scores, self.config, self.world, rollout.model_tokens())

    def train(self, rollout, scores, generated: Generated, advantages: torch.Tensor | None = None) -> Trained:
        """Forward, loss and backward over `rollout` (advantages: given, e.g. a slice of a larger
        rollout's, or computed from `scores`)."""
        global_tokens, global_sequences = self._batch_totals(rollout)
        if advantages is None:
            advantages = self.advantages(scores, rollout)
        return Trained(self.trainer.backward(rollout, advantages, global_tokens=global_tokens,
                                             global_sequences=global_sequences))

    def abandon(self, generated: Generated) -> None:
        """The step failed after generation: nothing of it may run on (a no-op for serial steps)."""

    def _batch_totals(self, rollout) -> tuple[float, float]:
        """Loss tokens and completions of every data-parallel rank's batch (a collective)."""
        return tuple(distributed.sum_floats([loss_tokens(rollout, self.config.mask_truncated),
                                             float(len(rollout.completions))], self.world, data_parallel=True))


class OverlappedSteps(SerialSteps):
    """Each group scored and trained as soon as it finishes (on a GPU on the pool's train stream),
    while the engine decodes the others; the optimizer step and publish wait for the last group, so
    every sample comes from the same weights."""

    overlapped = True

    def __init__(self, engine, task, config, world, trainer, *, agent=None, phases, memory, model_dir,
                 sequence_tokens: int, device: torch.device, train_stream=None):
        super().__init__(engine, task, config, world, trainer, agent)
        self.phases, self.memory, self.model_dir = phases, memory, model_dir
        self.sequence_tokens, self.device, self.train_stream = sequence_tokens, device, train_stream

    def generate(self, step: int, rows, prompts, sampling) -> Generated:
        # What the device holds outside the pool changes between steps (torch's cache, the engine's own
        # buffers): whether the gradients fit beside the KV cache is asked again each step.
        refusal = memory_refusal(self.memory, self.config, self.model_dir, self.sequence_tokens)
        if refusal is not None:
            return self._serially(step, rows, prompts, sampling, f"step {step} serial: {refusal}")
        self.phases.wake_gradients_for_overlap()
        overlapped = start_overlapped_step(self.task, step, self.config, self.world.dp_size, self.trainer.backward,
                                           keep=dynamic_sampling.informative if self.config.dynamic_sampling else None,
                                           device=self.device, train_stream=self.train_stream)
        trace = GenerationTrace()
        self.generating = True
        try:
            completions = self._rollouts(rows, prompts, sampling, trace=trace,
                                         on_group=overlapped.round(rows, prompts))
            if self.config.dynamic_sampling:  # the replacement prompts generate while the picked groups train
                dynamic_sampling.replace_while_training(step, overlapped, task=self.task, config=self.config,
                                                        world=self.world, engine=self.engine, rollouts=self._rollouts)
        except BaseException as e:
            # The groups trained so far are void: a retry (or the serial try below) starts from zeroed gradients.
            overlapped.abandon()
            self.phases.drop_gradients()
            cause = e.__cause__ if isinstance(e, GroupFailed) else e
            if not isinstance(cause, (MemoryError, torch.OutOfMemoryError)):
                raise
            self.generating = False
            return self._serially(step, rows, prompts, sampling,
                                  f"out of memory while training during generation ({type(cause).__name__}: "
                                  f"{str(cause)[:200]}); step {step} redone serially", warn=True)
        finally:
            self.generating = False
        overlapped.generation_done()  # the engine's thread gets its cores back; the groups left train in train()
        return Generated(completions, overlapped=overlapped, tail_s=trace.tail_s, engine_step_s=trace.median_step_s)

    def score(self, step: int, rollout, generated: Generated):
        if generated.overlapped is None:
            return super().score(step, rollout, generated)
        # scored as they finished
        return concatenated_scores(generated.overlapped.first_round_scores()), generated.overlapped.reward_s

    def informative(self, step: int, rollout, scores, generated: Generated):
        if generated.overlapped is None:
            return super().informative(step, rollout, scores, generated)
        return dynamic_sampling.overlapped_result(generated.overlapped)  # picked as they finished

    def train(self, rollout, scores, generated: Generated) -> Trained:
        if generated.overlapped is None:
            return super().train(rollout, scores, generated)
        stats, during = finish_overlap(generated.overlapped, self.memory, self.config.loss_type, self.world.dp_size,
                                       *self._batch_totals(rollout))
        return Trained(stats, {"overlap_train_s": during.seconds_during_generation,
                               "groups_trained_during_generation": during.trained_during_generation})

    def abandon(self, generated: Generated) -> None:
        if generated.overlapped is not None:  # the trainer's thread stops; on a GPU its stream is waited for
            generated.overlapped.abandon()

    def _serially(self, step, rows, prompts, sampling, why: str, warn: bool = False) -> Generated:
        if warn:
            logger.warning("rank %d: %s", self.world.rank, why)
        generated = super().generate(step, rows, prompts, sampling)
        generated.fallback = why
        return generated
