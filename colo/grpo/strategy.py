"""Serial or overlapped: how a step generates its rollout, scores it and trains on it. The scheduler
chooses one per run (colo.grpo.overlap.serial_reason says why a run is serial) and calls the same
methods either way:

    generated = strategy.generate_or_rebuild(step, batch, timeline)  # an engine that raised: rebuilt, once more
    scored = strategy.score(step, generated, timeline)    # dynamic_sampling: the informative groups, topped up
    for part in strategy.parts(scored):                   # one; TRL's steps_per_generation slices
        trained = strategy.train(part, generated)         # forward, loss, backward

Both train through the trainer they are given (colo.grpo.backward.PolicyTrainer: the views' model, the
reference, the memory sampled while activations are alive), not through the scheduler.

`SerialSteps` generates the whole batch, then scores it, then trains on it. `OverlappedSteps` scores
and trains each prompt's group as soon as its completions are done, while the engine decodes the
others (colo.grpo.overlap); a step whose gradients do not fit beside the KV cache that moment, or that
runs out of memory while training during generation, is generated again serially, and says why.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from . import distributed, dynamic_sampling
from .advantages import advantages_of
from .batch import Rollout, concatenated_scores, loss_tokens, rollout_of
from .metrics import agent_stats, reward_stats, train_stats
from .overlap import GroupFailed, OverlappedStep, finish_overlap, memory_refusal, start_overlapped_step
from .rollout_engine import EngineFailure, GenerationTrace, engine_error, rebuild_engine

if TYPE_CHECKING:  # types only: the agent's module loads for agentic runs alone
    from .agent import AgentStats
    from .task import Scores

logger = logging.getLogger(__name__)


@dataclass
class Generated:
    """One generation's outputs: the rollout (n completions per prompt, prompt after prompt) and the engine's
    completions it was made of, the overlapped step that scored and trained groups while generating (None:
    serial), the tail's seconds (fewer than a quarter of the sequences still decoding), and why an overlapped
    run generated this step serially."""
    rollout: Rollout
    completions: list
    overlapped: OverlappedStep | None = None
    tail_s: float = 0.0
    fallback: str | None = None
    engine_step_s: float = 0.0   # the median engine step's seconds (colo.grpo.rollout_engine.GenerationTrace)
    rebuild_s: float | None = None   # the engine's rebuild after it raised (None: it did not)
    agent: AgentStats | None = None  # a multi-turn rollout's tool figures (colo.grpo.agent)

    def fields(self, world) -> dict:
        """The step record's generation fields (agent_stats a collective: every rank of an agentic run)."""
        return {"generate_tail_s": self.tail_s, "engine_step_s_median": self.engine_step_s,
                "overlap": self.overlapped is not None,
                **({"overlap_fallback": self.fallback} if self.fallback else {}),
                **({"engine_rebuild_s": self.rebuild_s} if self.rebuild_s is not None else {}),
                **(agent_stats(self.completions, self.agent, world) if self.agent is not None else {})}


@dataclass
class Scored:
    """A step's scores: the sampled rollout's (the record's reward statistics are the step's own
    generation's) and the rollout it trains on with its scores (with dynamic_sampling its informative
    groups, topped up with new prompts'; else the sampled one)."""
    sampled: Rollout
    sampled_scores: Scores
    rollout: Rollout
    scores: Scores
    seconds: float                                   # the reward functions'
    counts: dict = field(default_factory=dict)       # dynamic_sampling/*

    def fields(self, world) -> dict:
        return {"reward_s": self.seconds, **reward_stats(self.sampled_scores, self.sampled, world), **self.counts}


@dataclass
class Part:
    """What one optimizer step trains on: a rollout with its scores, or a slice of one with its advantages
    (taken over the whole rollout)."""
    rollout: Rollout
    scores: Scores | None
    advantages: torch.Tensor | None = None


@dataclass
class Trained:
    """What forward, loss and backward over a rollout report (colo.grpo.backward.merge_stats), and,
    for an overlapped step, the trainer's seconds while the engine decoded and the groups trained then."""
    stats: dict
    during_generation: dict = field(default_factory=dict)   # overlap_train_s, groups_trained_during_generation
    routing_replay: bool = False

    def fields(self, world) -> dict:
        """The step record's training fields (a collective over the data-parallel ranks)."""
        return {**train_stats(self.stats, world), **self.during_generation,
                **({"routing_replay": self.routing_replay} if "router_compared" in self.stats else {})}


class SerialSteps:
    """Generate everything, then score, then train: `trainer` (colo.grpo.backward.PolicyTrainer) runs
    forward, loss and backward over the completions; `memory` (colo.grpo.train_memory.TrainingMemory)
    holds the gradients a rollout's slices each start from zero."""

    overlapped = False

    def __init__(self, engine, task, config, world, trainer, *, memory, agent=None):
        self.engine, self.task, self.config, self.world, self.trainer = engine, task, config, world, trainer
        self.memory = memory
        self.agent = agent  # multi-turn rollouts (colo.grpo.agent), or None: one engine call, one turn

    @property
    def generating(self) -> bool:
        """True while the engine decodes (memory sampled then counts as generation's)."""
        return self.trainer.generating

    @generating.setter
    def generating(self, value: bool) -> None:
        self.trainer.generating = value

    def generate_or_rebuild(self, step: int, batch, timeline) -> Generated:
        """This rank's generation of `batch` (rows, prompts, sampling options: colo.grpo.task.rank_batch);
        after an engine error the engine is rebuilt from the shared weights and tried once more. Every rank
        fails together rather than leaving the others waiting in an all-reduce."""
        error = generated = None
        try:
            generated, failure = self._try_generate(step, *batch)
            if failure is not None:
                rebuild_s = rebuild_engine(self.engine, failure, step=step, rank=self.world.rank, timeline=timeline)
                generated, second = self._try_generate(step, *batch)
                if second is not None:
                    raise EngineFailure(f"step {step}: generation failed twice on rank {self.world.rank}: first "
                                        f"{failure}; after rebuilding the engine from the shared weights: {second}")
                generated.rebuild_s = rebuild_s
        except EngineFailure as e:
            error = e
        except GroupFailed as e:  # a reward function or the trainer raised: that error, as it is
            raise e.__cause__ from None
        if distributed.sum_floats([1.0 if error else 0.0], self.world)[0]:
            if error is not None:
                raise error
            self.abandon(generated)
            raise EngineFailure(f"step {step}: generation failed on another rank (see its error)")
        self.trainer.residency.sample("generate")
        return generated

    def _try_generate(self, step: int, rows, prompts, sampling) -> tuple[Generated | None, str | None]:
        """(the generation, None), or (None, what the engine raised). Not the engine's and raised as they
        are: a request vLLM refused (ValueError: the run's settings), and a reward function's or the
        trainer's error (GroupFailed)."""
        try:
            return self.generate(step, rows, prompts, sampling), None
        except GroupFailed:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's; the caller rebuilds it once
            return None, engine_error(e, step)

    def generate(self, step: int, rows, prompts, sampling) -> Generated:
        trace = GenerationTrace()
        self.generating = True
        try:
            completions = self._rollouts(rows, prompts, sampling, trace=trace)
        finally:
            self.generating = False
        return self._generated(rows, prompts, completions, trace)

    def _generated(self, rows, prompts, completions, trace, **overlap) -> Generated:
        return Generated(rollout_of(rows, prompts, completions, self.config.num_generations), completions,
                         tail_s=trace.tail_s, engine_step_s=trace.median_step_s,
                         agent=self.agent.stats if self.agent is not None else None, **overlap)

    def _rollouts(self, rows, prompts, sampling, **options) -> list:
        if self.agent is not None:
            return self.agent.generate(rows, prompts, sampling, **options)
        return self.engine.generate(prompts, sampling, **options)

    def score(self, step: int, generated: Generated, timeline) -> Scored:
        """The generation's scores, and what the step trains on (with dynamic_sampling, its informative
        groups: colo.grpo.dynamic_sampling)."""
        scores, seconds = self._scores(step, generated.rollout, generated)
        if not self.config.dynamic_sampling:
            return Scored(generated.rollout, scores, generated.rollout, scores, seconds)
        with timeline.span("dynamic_sampling", step=step):
            rollout, kept, counts = self._informative(step, generated.rollout, scores, generated)
        return Scored(generated.rollout, scores, rollout, kept, seconds, counts)

    def _scores(self, step: int, rollout, generated: Generated | None):
        """(colo.grpo.task.Scores of every completion, the seconds the reward functions took)."""
        started = time.perf_counter()
        scores = self.task.score(step, rollout.rows, rollout.prompts, rollout.completions, **rollout.reward_inputs())
        return scores, time.perf_counter() - started

    def _informative(self, step: int, rollout, scores, generated: Generated):
        """Dynamic sampling: (the rollout the step trains on, its scores, the record's counts); the
        groups whose rewards are all equal replaced by new prompts' (colo.grpo.dynamic_sampling)."""
        def generate(rows, prompts, sampling):
            return SerialSteps.generate(self, step, rows, prompts, sampling).completions

        return dynamic_sampling.fill_with_informative_groups(
            step, rollout, scores, task=self.task, config=self.config, world=self.world, engine=self.engine,
            generate=generate,
            score=lambda more: SerialSteps._scores(self, step, more, None)[0])

    def advantages(self, scores, rollout) -> torch.Tensor:
        """Each completion's advantage (colo.grpo.advantages; a collective where it needs the batch's statistics)."""
        return advantages_of(scores, self.config, self.world, rollout.model_tokens())

    def parts(self, scored: Scored) -> Iterator[Part]:
        """What each of the step's optimizer steps trains on: the whole rollout, by default; TRL's
        steps_per_generation slices of its groups, num_iterations times over (serial steps only), each slice
        from zeroed gradients and each clipping against the log-probabilities of the weights the rollout was
        sampled with (a forward without gradients before the first update, as TRL computes its
        old_per_token_logps)."""
        cfg = self.config
        if cfg.steps_per_generation == 1 and cfg.num_iterations == 1:
            yield Part(scored.rollout, scored.scores)
            return
        rollout = scored.rollout
        advantages = self.advantages(scored.scores, rollout)
        rollout.old_logprobs = self.trainer.old_logprobs(rollout)
        groups = len(rollout.rows) // cfg.num_generations
        cuts = [round(k * groups / cfg.steps_per_generation) * cfg.num_generations
                for k in range(cfg.steps_per_generation + 1)]
        for iteration in range(cfg.num_iterations):
            for start, stop in zip(cuts, cuts[1:]):
                if iteration or start:  # the optimizer stepped on the slice before
                    self.memory.zero_grads()
                yield Part(rollout.part(start, stop), None, advantages[start:stop])

    def train(self, part: Part, generated: Generated) -> Trained:
        """Forward, loss and backward over `part` (its advantages: given, or computed from its scores)."""
        global_tokens, global_sequences = self._batch_totals(part.rollout)
        advantages = part.advantages if part.advantages is not None else self.advantages(part.scores, part.rollout)
        return Trained(self.trainer.backward(part.rollout, advantages, global_tokens=global_tokens,
                                             global_sequences=global_sequences), routing_replay=self.config.routing_replay)

    def abandon(self, generated: Generated | None) -> None:
        """The step failed after generation: nothing of it may run on (a no-op for serial steps)."""

    @contextlib.contextmanager
    def abandoned_on_failure(self, generated: Generated):
        """Whatever fails inside abandons the step's generation (the trainer's thread stops; on a GPU its
        stream is waited for) before it propagates."""
        try:
            yield
        except BaseException:
            self.abandon(generated)
            raise

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
        super().__init__(engine, task, config, world, trainer, memory=memory, agent=agent)
        self.phases, self.model_dir = phases, model_dir
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
        return self._generated(rows, prompts, completions, trace, overlapped=overlapped)

    def _scores(self, step: int, rollout, generated: Generated | None):
        if generated is None or generated.overlapped is None:
            return super()._scores(step, rollout, generated)
        # scored as they finished
        return concatenated_scores(generated.overlapped.first_round_scores()), generated.overlapped.reward_s

    def _informative(self, step: int, rollout, scores, generated: Generated):
        if generated.overlapped is None:
            return super()._informative(step, rollout, scores, generated)
        return dynamic_sampling.overlapped_result(generated.overlapped)  # picked as they finished

    def train(self, part: Part, generated: Generated) -> Trained:
        if generated.overlapped is None:
            return super().train(part, generated)
        stats, during = finish_overlap(generated.overlapped, self.memory, self.config.loss_type, self.world.dp_size,
                                       *self._batch_totals(part.rollout))
        return Trained(stats, {"overlap_train_s": during.seconds_during_generation,
                               "groups_trained_during_generation": during.trained_during_generation},
                       routing_replay=self.config.routing_replay)

    def abandon(self, generated: Generated | None) -> None:
        if generated is not None and generated.overlapped is not None:  # the trainer's thread stops; on a GPU its stream is waited for
            generated.overlapped.abandon()

    def _serially(self, step, rows, prompts, sampling, why: str, warn: bool = False) -> Generated:
        if warn:
            logger.warning("rank %d: %s", self.world.rank, why)
        generated = super().generate(step, rows, prompts, sampling)
        generated.fallback = why
        return generated
