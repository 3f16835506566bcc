"""Overlap: train each prompt's group as soon as all its completions are done, while the engine
decodes the others, exactly on-policy.

A GRPO step's generation ends in a tail: a few long completions decode while the device is mostly
idle. A group's advantages need only its own completions, so its forward and backward can run then.
The weights the engine samples with never change within a step: gradients only accumulate while it
decodes, and the optimizer step and the publish wait for the last group. The step is the serial
one up to the order of float summation:

- the loss's denominator (the batch's token count, or its number of sequences) is not known until the
  last group has finished (dynamic sampling replaces the groups that teach nothing): each group's loss
  is summed with a denominator of one token or one sequence, and the accumulated gradients (and the
  loss) are divided by the count once it is known;
- with dynamic sampling (colo.grpo.dynamic_sampling), a group whose rewards are all equal does not
  train, and the replacement prompts' groups generate while the groups picked so far train;
- the batch's reward std (scale_rewards="batch") and tensor parallelism (the trainer's collectives
  would interleave with the engine's on the same ranks) run serially, with a line saying why.

During generation the trainer runs on a thread of its own: on a GPU its kernels go to the pool's
`train` stream while the engine's run on theirs; on a CPU the cores are split between the two
(vLLM's CPU worker takes every core for its thread otherwise). The groups still waiting when
generation ends train on the step's thread, with every core.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..dtype_choice import fastest_dtype
from .batch import rollout_of
from .advantages import advantages_of, needs_the_whole_batch
from .loss import batch_total
from .backward import MICRO_BATCH_POSITIONS, merge_stats


# Whether an overlapped step measured faster than the serial one on both workloads of
# `python -m colo.bench --sections overlap` (the long-tail toy step and the real task), per device kind
# (device_kind) and dtype ("fp32"/"bf16"), and the file in bench/results that measured it: auto
# overlaps where it did. A pair not listed has not been measured, so auto leaves it serial.
# tests/grpo/test_grpo_overlap.py checks each decision against its file.
MEASURED_FASTER = {
    ("cpu-avx2", "fp32"): (False, "cpu-overlap-avx2-persona-full.json"),
    ("cpu-avx512-bf16", "bf16"): (False, "cpu-overlap-zen5-full.json"),
}


def device_kind(device_type: str) -> str:
    """The kind of device overlap's measurements are keyed by: "cuda", or the CPU's fastest matmul units."""
    if device_type != "cpu":
        return device_type
    caps = torch.cpu.get_capabilities()
    for feature, kind in (("amx_bf16", "cpu-amx"), ("avx512_bf16", "cpu-avx512-bf16"), ("avx512_f", "cpu-avx512"),
                          ("avx2", "cpu-avx2")):
        if caps.get(feature) is True:
            return kind
    return "cpu"


def serial_reason(config, *, device_type: str, groups: int, stop_tokens: bool = False) -> str | None:
    """Why this run's steps cannot overlap training with generation (None: they can, memory aside).
    stop_tokens: the task ends completions at tokens of its own (so lengths differ even with ignore_eos)."""
    if config.overlap == "off":
        return "overlap is off"
    if config.overlap == "auto":
        measured = (device_kind(device_type), config.dtype or fastest_dtype(device_type).name)
        if not MEASURED_FASTER.get(measured, (False, None))[0]:
            return (f"overlap=auto: an overlapped step has not measured faster than a serial one on this device "
                    f"kind in this dtype ({measured[0]}, {measured[1]}; colo.grpo.overlap.MEASURED_FASTER); "
                    "--overlap on (overlap='on') runs it anyway")
        if config.ignore_eos and not stop_tokens:
            return ("overlap=auto: ignore_eos and no stop tokens: every completion decodes max_new_tokens tokens, "
                    "so the groups finish together and none could train early")
    if config.steps_per_generation > 1:
        return f"steps_per_generation={config.steps_per_generation}: the rollout trains in slices after its generation"
    if config.num_iterations > 1:
        return (f"num_iterations={config.num_iterations}: each rollout is trained on several times, after its "
                "generation")
    if config.tensor_parallel > 1:
        return ("tensor parallelism: the trainer's collectives would interleave with the engine's on the same "
                "ranks")
    whole_batch = needs_the_whole_batch(config)
    if whole_batch:
        return whole_batch
    if groups < 2:
        return "one prompt per rank: its group is the last to finish, so nothing could train early"
    return None


def memory_refusal(memory, config, model_dir, longest_sequence: int) -> str | None:
    """Why the gradients and one group's activations (colo.plan's estimate of one micro-batch) cannot be
    awake beside what the engine keeps awake while it generates (None: they fit)."""
    from ..plan import activation_bytes, shape_from_config

    n = config.num_generations
    rows = min(config.micro_batch_size or n, n)  # one micro-batch of one group, within backward's cap on positions
    positions = min(rows * longest_sequence, max(MICRO_BATCH_POSITIONS, longest_sequence))
    activations = activation_bytes(shape_from_config(str(model_dir / "config.json")), positions)[0]
    if memory.gradients_fit_while_generating(activations):
        return None
    return (f"the gradients and one group's activations (~{activations} bytes, colo.plan's estimate) do not fit in "
            "the pool beside what is awake while the engine generates (its weights and KV cache)")


@dataclass
class GroupResults:
    """Every group's result (the scheduler merges them in prompt order), and how many groups trained,
    and for how long, while the engine was still decoding."""
    results: dict = field(default_factory=dict)   # prompt index -> the work function's result
    trained_during_generation: int = 0            # groups whose training started before generation ended
    seconds_during_generation: float = 0.0        # trainer time spent while the engine was decoding


class GroupTrainer:
    """Runs `work(index, completions)` for each finished group in the order the groups finish: on a
    background thread while the engine decodes, and the groups still waiting when generation ends on
    the step's thread in join(). submit() is called by the engine's loop; generation_done() when it
    returns; join() returns the GroupResults (re-raising the first error).

    On a CPU, while the trainer has work during generation, the engine's thread uses `engine_threads`
    and the trainer's `trainer_threads` (their sum may exceed the cores). The groups left at the end
    train on the step's thread with its own threads, where they ran faster than on the trainer's
    thread once generation had ended (two OpenMP teams then still share the cores).
    stream: on a GPU, the torch stream the trainer's kernels go to."""

    def __init__(self, work: Callable, *, device: torch.device, engine_threads: int, trainer_threads: int,
                 stream=None):
        self.work, self.device, self.stream = work, device, stream
        self.engine_threads, self.trainer_threads = max(1, engine_threads), max(1, trainer_threads)
        self.outcome = GroupResults()
        self._queue: queue.Queue = queue.Queue()
        self._late: list = []  # groups the trainer's thread took after generation ended, for join()
        self._generating = True
        self._generation_ended: float | None = None
        self._error: BaseException | None = None
        self._engine_threads = None
        self._threads_before = torch.get_num_threads()
        if stream is not None:  # the gradients were woken and zeroed on the step's stream
            stream.wait_stream(torch.cuda.current_stream(device))
        self._thread = threading.Thread(target=self._run, name="colo-group-trainer", daemon=True)
        self._thread.start()

    # -- the engine's side ---------------------------------------------------------------------------
    def submit(self, index: int, completions) -> None:
        if self._error is not None:  # stop the engine's loop at once: the step has failed
            raise self._error
        if self.device.type == "cpu" and self._generating and self._engine_threads is None:
            # From now on the trainer has work: the engine's thread leaves it its share of the cores.
            self._engine_threads = torch.get_num_threads()
            torch._C.set_num_threads(self.engine_threads)
        self._queue.put((index, completions))

    def generation_done(self) -> None:
        if self._generating:
            self._generating, self._generation_ended = False, time.perf_counter()
        self._restore_engine_threads()

    def join(self) -> GroupResults:
        """Wait for the group in hand, then train the groups left here, on the step's thread."""
        self.join_quietly()
        if self._error is not None:
            raise self._error
        for index, completions in self._late + self._drain():
            self.outcome.results[index] = self.work(index, completions)
        return self.outcome

    def abandon(self) -> None:
        """Stop after the group in hand and drop the rest (generation or the train phase failed): the
        step's stream then waits for the train stream, so nothing the trainer queued runs after what
        the step does next (a retry, a checkpoint, the exit)."""
        self._drain()
        self.join_quietly()
        self._late.clear()

    def _drain(self) -> list:
        """The groups still queued, in order (the trainer's stop marks dropped)."""
        items = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    items.append(item)
        return items

    def join_quietly(self) -> None:
        """Wait for the trainer's thread to end; on a GPU the step's own work (the groups left, the
        all-reduce, the optimizer, or whatever follows a failure) is then ordered after the train
        stream's."""
        self.generation_done()
        self._queue.put(None)
        self._thread.join()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self.device.type == "cpu":
            # set_num_threads also sets process-wide counts (MKL's, new threads'): the trainer's last
            # setting must not outlive the step.
            torch._C.set_num_threads(self._threads_before)

    def catch_up(self) -> None:
        """Called on the trainer's thread between a group's forward and backward: once generation has
        ended, the group in hand finishes on the step's threads, not on its share of the cores."""
        if (self.device.type == "cpu" and not self._generating and threading.current_thread() is self._thread
                and torch.get_num_threads() != self._threads_before):
            torch._C.set_num_threads(self._threads_before)

    def _restore_engine_threads(self) -> None:
        if self._engine_threads is not None:
            torch._C.set_num_threads(self._engine_threads)
            self._engine_threads = None

    # -- the trainer's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        if self.device.type == "cpu":  # per thread: the engine's thread keeps its own count
            # torch's first use in a thread sets its count to the last one set in any thread; have that
            # happen now, not after the engine's thread sets its own.
            torch.get_num_threads()
            torch._C.set_num_threads(self.trainer_threads)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            while True:
                item = self._queue.get()
                if item is None or self._error is not None:
                    return
                if not self._generating:  # for the step's thread (join)
                    self._late.append(item)
                    return
                started = time.perf_counter()
                try:
                    self.outcome.results[item[0]] = self.work(*item)
                except BaseException as e:  # noqa: BLE001 - handed to the step's thread, which raises it
                    self._error = e
                    return
                # The part of its training that ran while the engine was decoding.
                ended = self._generation_ended or time.perf_counter()
                self.outcome.trained_during_generation += 1
                self.outcome.seconds_during_generation += max(0.0, min(ended, time.perf_counter()) - started)


class GroupFailed(Exception):
    """A finished group's scoring or training raised (its __cause__): the step fails with that error,
    and the engine, which did nothing wrong, is not rebuilt."""


class RoundPicks:
    """Which groups of one round of generation train, whatever order they finish in: the first `quota`
    groups that `keep` accepts, in prompt order (as a serial step picks them). A finished group is
    handed on as soon as no group before it that is unfinished or kept could take its place."""

    def __init__(self, first: int, size: int, quota: int):
        self.first, self.size, self.quota = first, size, quota
        self.kept: dict[int, bool] = {}   # finished groups' index -> kept
        self.picked: list[int] = []   # in prompt order

    def finished(self, index: int, kept: bool) -> list[int]:
        """The groups (indices over all rounds) now sure to train, in prompt order."""
        self.kept[index] = kept
        now, ahead = [], 0   # ahead: groups before this one that are kept or may still be
        for i in range(self.first, self.first + self.size):
            if ahead >= self.quota:
                break
            if self.kept.get(i, True):
                if i in self.kept and i not in self.picked:
                    now.append(i)
                ahead += 1
        self.picked = sorted(self.picked + now)
        return now


class OverlappedStep:
    """One step's groups trained as they finish, over one or more rounds of generation (the step's own
    prompts, then dynamic sampling's replacement prompts). A round's on_group(i, completions) runs on the engine's
    thread as its i-th prompt's group finishes: `score(rows, prompts, completions)` returns (Scores,
    work) there (rewards are the user's code, run in order as in a serial step), and each group the
    round picks (RoundPicks, `keep(scores)`) runs `train(index, work)` on the trainer's thread; index
    counts groups over every round."""

    def __init__(self, score: Callable, train: Callable, *, keep: Callable | None = None, **trainer_options):
        self.score, self.keep = score, keep or (lambda scores: True)
        self.scores: dict = {}   # group index -> its Scores
        self.works: dict = {}    # group index -> what train() takes
        self.rounds: list[RoundPicks] = []
        self.reward_s = 0.0
        self.trainer = GroupTrainer(train, **trainer_options)

    def round(self, rows, prompts, quota: int | None = None) -> Callable:
        """The on_group callback of a round of generation of these prompts (quota: at most that many of
        its groups train; all by default)."""
        picks = RoundPicks(sum(r.size for r in self.rounds), len(prompts), len(prompts) if quota is None else quota)
        self.rounds.append(picks)

        def on_group(i: int, completions) -> None:
            self._finished(picks, i, rows[i:i + 1], prompts[i:i + 1], completions)
        return on_group

    def _finished(self, picks: RoundPicks, i: int, rows, prompts, completions) -> None:
        index = picks.first + i
        started = time.perf_counter()
        try:
            self.scores[index], self.works[index] = self.score(rows, prompts, completions)
        except Exception as e:
            raise GroupFailed(f"group {index}: {type(e).__name__}: {e}") from e
        self.reward_s += time.perf_counter() - started
        for picked in picks.finished(index, self.keep(self.scores[index])):
            self.train(picked)

    def train(self, index: int) -> None:
        """Hand group `index` (scored) to the trainer."""
        try:
            self.trainer.submit(index, self.works[index])
        except Exception as e:
            raise GroupFailed(f"training group {index}: {type(e).__name__}: {e}") from e

    def picked(self) -> list[int]:
        """The groups picked to train, over every round, in order."""
        return [i for r in self.rounds for i in r.picked]

    def first_round_scores(self) -> list:
        """The Scores of the step's own prompts' groups, in prompt order."""
        return [self.scores[i] for i in range(self.rounds[0].size)]

    def generation_done(self) -> None:
        self.trainer.generation_done()

    def join(self) -> GroupResults:
        return self.trainer.join()

    def abandon(self) -> None:
        self.trainer.abandon()


def start_overlapped_step(task, step: int, config, dp_size: int, backward: Callable, *, keep: Callable | None = None,
                          device: torch.device, train_stream=None) -> OverlappedStep:
    """Each round's groups scored by `task` and the ones picked trained, backward(group, advantages,
    global_tokens=, global_sequences=, after_forward=), as soon as they finish (the gradients must be
    awake and zeroed); backward calls after_forward() between each micro-batch's forward and backward.
    How many tokens and sequences the step trains on is known when its last group has finished: each
    group's loss is summed with denominators of one token or sequence per rank, and finish_overlap
    divides by the batch's count."""
    n = config.num_generations

    def score(rows, prompts, completions):
        group = rollout_of(rows, prompts, completions, n)
        scores = task.score(step, group.rows, group.prompts, group.completions, **group.reward_inputs())
        return scores, (group, advantages_of(scores, config, None))  # one group's (needs_the_whole_batch: None)

    def train(i, work):
        group, advantages = work
        return backward(group, advantages, after_forward=overlapped.trainer.catch_up,
                        global_tokens=float(dp_size), global_sequences=float(dp_size))

    engine_threads, trainer_threads = config.overlap_threads or cpu_split(torch.get_num_threads())
    overlapped = OverlappedStep(score, train, keep=keep, device=device, engine_threads=engine_threads,
                                trainer_threads=trainer_threads, stream=train_stream)
    return overlapped


def cpu_split(cores: int) -> tuple[int, int]:
    """The engine's and the trainer's threads while both have work on a CPU of `cores` cores."""
    return max(1, cores - cores // 2), max(1, cores // 2)


def finish_overlap(overlapped: OverlappedStep, memory, loss_type: str, ranks: int, global_tokens: float,
                   global_sequences: float) -> tuple[dict, GroupResults]:
    """Wait for the last groups; return the batch's statistics and the groups' results, the accumulated
    gradients and the loss divided by the batch's share of the count the loss type divides by."""
    outcome = overlapped.join()
    stats = merge_stats([outcome.results[i] for i in sorted(outcome.results)])
    scale = ranks / max(batch_total(loss_type, global_tokens, global_sequences), 1.0)
    for flat in memory.flat_grads.values():
        flat.mul_(scale)
    stats["loss"] *= scale
    return stats, outcome
