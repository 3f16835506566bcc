"""The GRPO phase machine: generate, reward, train, publish, one device, one pool, one copy of the weights.

One step:

    generate  KV region awake; the whole rollout batch in one engine call (n completions per prompt)
    reward    the user's function scores every completion; advantages are normalised per prompt group
    train     KV region asleep (resident bytes 0); gradients mapped; optimizer state copied back on
              the copy stream while the forward and backward passes run; gradients averaged over
              ranks; clip; optimizer step (with shard_optimizer, ZeRO-1: gradients reduce-scattered
              to their shard's rank, each rank steps its shard and all-gathers the updated weights
              straight into the engine's)
    publish   gradients released and (on a GPU, by default) the optimizer state's copy to host
              started; the engine serves the new weights (no bytes copied when layouts match) while
              that copy runs; the step ends once it is done, before the KV cache wakes again

Every rank of a torchrun job runs this same loop with its own engine and its share of the prompts.
With tensor parallelism (config.tensor_parallel = T) an engine spans T consecutive ranks: each holds
its shards of the weights and the trainer's model on it is those shards (colo.tensor_parallel); the T
ranks see the same prompts, and prompts and gradients are split and averaged over the data-parallel
ranks only.

Checkpoints are colo.grpo.checkpoint.Checkpointer's: which one a resumed run continues from, restoring
it, what a save holds. The scheduler decides when to save: every save_every steps, at the end, after
the step a SIGTERM interrupted, and on the way out of a failure that left the weights whole.
"""
from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..checks import check_int
from ..errors import ModelSaveError, NonFiniteGradients, Terminated
from ..hub import resolve_model
from ..pool import Pool
from ..regions import WEIGHTS
from ..zero import ShardLayout
from . import distributed
from .backward import backward_rollout, frozen_copy
from .batch import Rollout, concatenated_scores, loss_tokens, rollout_of
from .checkpoint import Checkpointer
from .config import GRPOConfig, check_model_dir
from .evaluation import greedy_pass_at_1
from .gradients import reduce_and_clip
from .hf_format import FINAL, check_writable, model_step_dir
from .loss import group_advantages
from .metrics import ProgressBar, StepLog, Timeline, rank_path
from .overlap import GroupFailed, OverlappedStep, finish_overlap, memory_refusal, serial_reason, start_overlapped_step
from .rollout_engine import EngineFailure, GenerationTrace, RolloutEngine, generate_or_rebuild
from .task import Task
from .step_stats import Residency, reward_stats, scored_mean_std, train_stats
from .task_setup import build_tasks, checked_prompts, fit_model_length, longest_sequence, sampling_options
from .termination import TerminationRequest
from .trackers import Trackers
from .train_memory import TrainingMemory

logger = logging.getLogger(__name__)

PromptFn = Callable[[int, int], list]          # (step, count) -> list of prompts (token id lists)
RewardFn = Callable[[list, list], list]        # (prompts, completions) -> one float per completion


class GRPOScheduler:
    """Runs GRPO steps on `model_dir` (a Hugging Face causal LM directory, or a hub id ORG/NAME: colo.hub)
    colocated with a vLLM engine.

    What it trains on, one of:
    - dataset + reward_funcs (TRL's conventions; colo.grpo.task.DatasetTask): a `datasets.Dataset` or
      a file/directory path with a `prompt` column (text, or messages through the model's chat
      template), reward functions f(prompts, completions, completion_ids, **columns) or their names
      (colo.grpo.rewards), reward_weights; eval_dataset for greedy pass@1 every config.eval_every steps.
    - prompt_fn + reward_fn, token ids only: prompt_fn(step, count) returns `count` prompts (lists of
      token ids) for a step; it must depend only on its arguments so a resumed run sees the same
      prompts. reward_fn(prompts, completions) returns one float per completion, prompts repeated once
      per completion.
    - task: a colo.grpo.task.Task.
    out_dir: where checkpoints go (None: no checkpoints), and the model in Hugging Face format: out_dir/final
    at the end, out_dir/model-step-N every config.save_model_every steps (colo.grpo.hf_format). resume=True
    continues from its latest checkpoint.
    pool_capacity: bytes of the device (or RAM) this run's pool may use; default: all that is free.
    The regions time-share it: the KV cache may use the bytes of the training memory that sleeps
    while generating (see colo.Pool).
    """

    def __init__(self, model_dir: str | Path, reward_fn: RewardFn | None = None, prompt_fn: PromptFn | None = None,
                 config: GRPOConfig | None = None, *, dataset=None, reward_funcs=None, reward_weights=None,
                 eval_dataset=None, tokenizer=None, task: Task | None = None, out_dir: str | Path | None = None,
                 log_path: str | Path | None = None, trace_path: str | Path | None = None,
                 resume: bool = False, engine_options: dict | None = None, pool_capacity: int | None = None):
        self.config = config or GRPOConfig()
        self.model_dir = resolve_model(model_dir)  # a directory, or a hub id ORG/NAME from the hub's cache
        self.out_dir = Path(out_dir) if out_dir is not None else None
        check_model_dir(self.model_dir, self.config.tensor_parallel)  # before any engine starts
        if self.out_dir is not None:
            check_writable(self.out_dir, "out_dir")
        self.task, self.eval_task = build_tasks(self.config, self.model_dir, task, dataset, reward_funcs,
                                                reward_weights, eval_dataset, tokenizer, prompt_fn, reward_fn)
        engine_options = fit_model_length(self.config, self.model_dir, (self.task, self.eval_task),
                                          dict(engine_options or {}))
        self._join_world()
        resume_state = Checkpointer.find_resume_state(self.out_dir, self.config, self.world) if resume else None
        torch.manual_seed(self.config.seed + self.world.dp_rank)  # an engine's tensor-parallel ranks alike
        self.pool = Pool(self.device, capacity=pool_capacity)
        self.residency = Residency(self.pool, self.device)
        self.config = self.config.resolve_dtype(self.device)
        self.sequence_tokens = longest_sequence(self.config, self.task)  # may ask the task for step 1's prompts
        self._start_engine(engine_options or {})
        self._build_training()
        self.serial_reason = self._overlap_refusal()  # None: each step trains finished groups while generating
        self.timeline = Timeline(rank_path(trace_path, self.world.rank), rank=self.world.rank, append=resume)
        self.checkpointer = Checkpointer(self.out_dir, self.config, self.world, self.model_dir, engine=self.engine,
                                         model=self.model, tp=self.tp, adapter=self.adapter, memory=self.memory,
                                         optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                                         reference=self.reference, timeline=self.timeline)
        self.step = self.checkpointer.restore(resume_state) if resume_state is not None else 0
        self.log = StepLog(log_path if self.world.is_main else None,
                           resume_after_step=self.step if resume else None)
        self.trackers = self._open_trackers(log_path, resume) if self.world.is_main else None
        # True from the optimizer step until the publish: the weights are half-changed, and a failure
        # then must not checkpoint them (run() saves on the way out only when this is False).
        self._unsafe_to_save = False
        self.skipped_in_a_row = 0  # steps whose gradient norm was not finite, up to the last one
        self._generating = False  # True while the engine generates (groups may train meanwhile: --overlap)
        self._serial_this_step = False

    # -- set-up ------------------------------------------------------------------------------------
    def _join_world(self) -> None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        # on a GPU also makes this rank's device current
        self.world = distributed.init_world(device_type, self.config.tensor_parallel)
        self.device = torch.device("cuda", self.world.local_rank) if device_type == "cuda" else torch.device("cpu")
        if self.config.prompts_per_step < self.world.dp_size:
            raise ValueError(f"prompts_per_step={self.config.prompts_per_step} leaves ranks without prompts: "
                             f"it must be at least the number of data-parallel ranks ({self.world.dp_size})")

    def _start_engine(self, engine_options: dict) -> None:
        """The engine first: vLLM loads the weights into the pool, and the trainer's model is a view of them."""
        lora = self.config.lora_spec
        # The zero adapter the engine loads once at start (one directory per rank: no shared writes).
        self._workdir = tempfile.TemporaryDirectory(prefix="colo-grpo-") if lora else None
        self.engine = RolloutEngine(self.model_dir, self.pool, seed=self.config.seed, dtype=self.config.torch_dtype,
                                    max_num_seqs=self._sequences_per_rank(),
                                    sequence_tokens=self.sequence_tokens, lora=lora,
                                    workdir=self._workdir.name if lora else None,
                                    tensor_parallel=self.config.tensor_parallel, **engine_options)
        self.model = self.engine.hf_model
        self.tp = self.engine.tensor_parallel  # this rank's TensorParallelModel, or None
        self.adapter = self.engine.adapter
        self.reference = None
        if self.config.beta > 0:  # with an adapter the reference is the shared base itself: no copy
            self.reference = self.adapter.base_model(self.model) if self.adapter else frozen_copy(self.model)

    def _build_training(self) -> None:
        """Gradients, optimizer state and the optimizer, with exact budgets in the pool."""
        cfg = self.config
        params = [p for p in self.model.parameters() if p.requires_grad]
        # The training memory gets its budgets beside the weights while the KV cache sleeps (they
        # time-share the pool), and sleeps itself before the first generation wakes the KV cache.
        if cfg.memory_phases:
            self.engine.sleep_kv_cache()
        # ZeRO-1: this rank's shard of masters and moments; the all-gather lands in the engine's weights.
        # With tensor parallelism, over the data-parallel ranks (those holding the same shards).
        shard = ShardLayout(params, self.world.dp_size, self.world.dp_rank, store_region=self.pool.regions[WEIGHTS]) \
            if cfg.shard_optimizer else None
        self.memory = TrainingMemory(self.pool, params, offload_optimizer=cfg.offload_optimizer, shard=shard,
                                     shard_group=self.world.dp_group,
                                     scales=self.adapter.scales() if self.adapter else None)
        # fp32 parameters: AdamW itself; bf16: a colo.MasterWeightOptimizer stepping fp32 masters in the
        # optimizer region; sharded: a colo.ShardedMasterWeightOptimizer.
        self.optimizer = self.memory.build_optimizer(torch.optim.AdamW, lr=cfg.learning_rate, betas=cfg.adam_betas,
                                                     weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            getattr(self.optimizer, "optimizer", self.optimizer), lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)
        if cfg.memory_phases:
            self.memory.sleep_for_generation()
            self.memory.finish_offload()

    def _open_trackers(self, log_path, resume: bool) -> Trackers | None:
        """The experiment trackers config.report_to names (None: none), with the run's config."""
        if not self.config.report_to:
            return None
        log_dir = self.out_dir or (Path(log_path).parent if log_path else Path.cwd())
        name = self.config.run_name or (self.out_dir.name if self.out_dir else time.strftime("colo-grpo-%Y%m%d-%H%M%S"))
        return Trackers(self.config.report_to, run_name=name, log_dir=log_dir, resumed_after=self.step if resume else None,
                        config={"model_dir": str(self.model_dir), **self.config.to_dict()})

    def _overlap_refusal(self) -> str | None:
        """Why this run's steps are serial (None: they overlap); logged once, a warning where asked for."""
        reason = serial_reason(self.config, device_type=self.device.type, stop_tokens=bool(self.task.stop_token_ids),
                               groups=len(distributed.rank_share(self.config.prompts_per_step, self.world)))
        reason = reason or memory_refusal(self.memory, self.config, self.model_dir, self.sequence_tokens)
        if reason is not None:
            (logger.warning if self.config.overlap == "on" else logger.info)("serial GRPO steps: %s", reason)
        return reason

    def _sequences_per_rank(self) -> int:
        return len(distributed.rank_share(self.config.prompts_per_step, self.world, rank=0)) * self.config.num_generations

    # -- the step ----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Run one GRPO step (the next one) and return its metrics record."""
        step = self.step + 1
        record: dict = {"step": step, "dtype": self.config.dtype}
        started = time.perf_counter()
        rollout = self._generate_phase(step, record)
        try:
            rewards = self._reward_phase(step, rollout, record)
            self._train_phase(step, rollout, rewards, record)
        except BaseException:
            if rollout.overlapped is not None:  # the trainer's thread stops; on a GPU its stream is waited for
                rollout.overlapped.abandon()
            raise
        self._publish_phase(step, record)
        # The optimizer state's copy out overlapped the publish; between steps every region is settled
        # (a user may checkpoint, or wake the KV cache, before the next step).
        switch = time.perf_counter()
        self.memory.finish_offload()
        record["phase_switch_s"] += time.perf_counter() - switch
        record["step_s"] = time.perf_counter() - started
        record["tokens_per_s"] = record["tokens_generated"] / record["step_s"]
        record["lr"] = self.lr_scheduler.get_last_lr()[0]
        self.step = step
        if self.eval_task is not None and self.config.eval_every and step % self.config.eval_every == 0:
            record.update(self.evaluate())
        return record

    def _generate_phase(self, step: int, record: dict) -> "Rollout":
        cfg = self.config
        all_rows, all_prompts = self.task.batch(step, cfg.prompts_per_step)
        all_prompts = checked_prompts(cfg, all_prompts, step, self.engine.vocab_size, self.engine.max_model_len)
        share = distributed.rank_share(cfg.prompts_per_step, self.world)  # uneven when the ranks do not divide it
        prompts = all_prompts[share.start:share.stop]
        self._serial_this_step = False  # set when an overlapped try runs out of memory
        with self.timeline.span("generate", step=step) as span:
            switch = time.perf_counter()
            if self.engine.kv_cache_asleep:
                self.engine.wake_kv_cache()  # also forgets prefixes whose KV was lost
            record["phase_switch_s"] = time.perf_counter() - switch
            error = None
            rows = all_rows[share.start:share.stop]
            try:
                outputs, overlapped = generate_or_rebuild(
                    self.engine, lambda: self._generate(step, rows, prompts, share, record), step=step,
                    rank=self.world.rank, timeline=self.timeline, record=record, not_the_engines=GroupFailed)
            except EngineFailure as e:
                error = e
            except GroupFailed as e:  # a reward function or the trainer raised: that error, as it is
                raise e.__cause__ from None
            # All ranks fail together rather than leaving the others waiting in an all-reduce.
            failed = distributed.sum_floats([1.0 if error else 0.0], self.world)[0]
            if error is not None:
                raise error
            if failed:
                if overlapped is not None:
                    overlapped.abandon()
                raise EngineFailure(f"step {step}: generation failed on another rank (see its error)")
            self.residency.sample("generate", record)
        record["generate_s"] = span["seconds"]
        record["overlap"] = overlapped is not None
        rollout = rollout_of(rows, prompts, outputs, cfg.num_generations)
        rollout.overlapped = overlapped
        return rollout

    def _generate(self, step, rows, prompts, share, record):
        """One try: the completions and the OverlappedStep (None: serial). On any error the groups
        trained so far are abandoned and the gradients sleep again (a retry starts from zeroed ones);
        out of memory while training during generation, the step is generated again, serially."""
        overlapped = self._start_overlap(step, rows, prompts, record)
        trace = GenerationTrace()
        self._generating = True
        try:
            outputs = self.engine.generate(prompts, sampling_options(self.config, self.task, step, share), trace=trace,
                                           on_group=overlapped.on_group if overlapped else None)
        except BaseException as e:
            if overlapped is None:
                raise
            overlapped.abandon()
            self.memory.grads.sleep(offload=False)  # what the groups accumulated is void
            cause = e.__cause__ if isinstance(e, GroupFailed) else e
            if not _out_of_memory(cause):
                raise
            record["overlap_fallback"] = (f"out of memory while training during generation ({type(cause).__name__}: "
                                          f"{str(cause)[:200]}); step {step} redone serially")
            logger.warning("rank %d: %s", self.world.rank, record["overlap_fallback"])
            self._serial_this_step = True
            self._generating = False
            return self._generate(step, rows, prompts, share, record)
        finally:
            self._generating = False
        if overlapped is not None:
            overlapped.generation_done()  # the engine's thread gets its cores back; the groups left train in join()
        record["generate_tail_s"] = trace.tail_s
        return outputs, overlapped

    def _start_overlap(self, step, rows, prompts, record) -> OverlappedStep | None:
        """The gradients wake (zeroed) before generation, and each group trains as it finishes."""
        if self.serial_reason is not None or self._serial_this_step:
            return None
        # What the device holds outside the pool changes between steps (torch's cache, the engine's
        # own buffers): whether the gradients fit beside the KV cache is asked again each step.
        refusal = memory_refusal(self.memory, self.config, self.model_dir, self.sequence_tokens)
        if refusal is not None:
            record["overlap_fallback"] = f"step {step} serial: {refusal}"
            return None
        self.memory.wake_gradients()
        stream = self.pool.stream("train").torch_stream() if self.device.type == "cuda" else None
        return start_overlapped_step(
            self.task, step, rows, prompts, self.config, self.world.dp_size,
            lambda group, advantages, **options: self._backward(group, advantages, record, **options),
            device=self.device, train_stream=stream)

    def _reward_phase(self, step, rollout: "Rollout", record) -> torch.Tensor:
        """Every completion's reward (NaN: no function could score it) and the step's reward record:
        overall and per function, mean and std over every rank's completions, as TRL logs them."""
        if rollout.overlapped is not None:  # scored group by group as they finished
            scores = concatenated_scores(rollout.overlapped.scores)
            record["reward_s"] = rollout.overlapped.reward_s
        else:
            with self.timeline.span("reward", step=step) as span:
                scores = self.task.score(step, rollout.rows, rollout.prompts, rollout.completions)
            record["reward_s"] = span["seconds"]
        record.update(reward_stats(scores, rollout, self.world))
        return scores.total

    def _train_phase(self, step, rollout: "Rollout", rewards, record) -> None:
        cfg = self.config
        with self.timeline.span("train", step=step) as span:
            switch = time.perf_counter()
            if cfg.memory_phases:
                self.engine.sleep_kv_cache()
            if rollout.overlapped is None:
                self.memory.wake_for_training()  # optimizer state starts coming back on the copy stream
            else:  # the gradients are awake since generation began, holding the groups trained so far
                self.memory.start_prefetch()
            record["phase_switch_s"] += time.perf_counter() - switch
            self.timeline.counter("resident_bytes", self.residency.resident())
            global_tokens, global_sequences = distributed.sum_floats([loss_tokens(rollout, cfg.mask_truncated),
                                                            float(len(rollout.completions))],
                                                           self.world, data_parallel=True)
            collectives = self.tp.collectives.total if self.tp else 0
            if rollout.overlapped is None:
                # scale_rewards="batch": the std of every rank's rewards
                batch_std = scored_mean_std(rewards, self.world)[1] if cfg.scale_rewards == "batch" else None
                advantages = group_advantages(rewards, cfg.num_generations, scale=cfg.scale_rewards,
                                              allow_unscorable=True, batch_std=batch_std)
                stats = self._backward(rollout, advantages, record, global_tokens=global_tokens,
                                       global_sequences=global_sequences)
            else:
                stats = finish_overlap(rollout.overlapped, self.memory, self.config.loss_type, self.world.dp_size,
                                       global_tokens, record)
            self.memory.check_grads_attached()
            record["grad_norm"] = reduce_and_clip(self.memory, self.optimizer, self.world, cfg.max_grad_norm,
                                                  tp=self.tp)
            self.residency.sample("train", record)
            self.memory.finish_prefetch()
            # A norm that is not finite (the same on every rank) skips the update: the weights the engine
            # serves stay as they were, and the next step starts from zeroed gradients.
            record["step_skipped"] = not math.isfinite(record["grad_norm"])
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if record["step_skipped"] else 0
            record["skipped_steps_in_a_row"] = self.skipped_in_a_row
            if not record["step_skipped"]:
                self._unsafe_to_save = True
                self.optimizer.step()  # sharded: also all-gathers every rank's updated weights into the engine's
                self.memory.adopt_optimizer_state(self.optimizer)  # no-op after the first step
                self.lr_scheduler.step()
            record["optimizer_state_bytes"] = self.memory.optimizer_state_bytes()
        record["train_s"] = span["seconds"]
        if self.tp is not None:  # the step's tensor-parallel all-reduces (forward, backward, vocabulary, KV heads)
            record["tp_all_reduces"] = self.tp.collectives.total - collectives
        record.update(train_stats(stats, self.world))

    def _backward(self, rollout: "Rollout", advantages, record, *, after_forward=lambda: None, **totals) -> dict:
        def forward_done():  # activations alive: the moment to sample memory (and the overlap's catch_up)
            # A group trained while the KV cache is still awake (during generation, or the group in hand
            # when it ends: --overlap) is counted with generation; the train phase's figures are those
            # with the KV cache asleep.
            awake = self._generating or (self.config.memory_phases and not self.engine.kv_cache_asleep)
            self.residency.sample("generate" if awake else "train", record)
            after_forward()

        return backward_rollout(self.tp or self.model, rollout, advantages, self.config, device=self.device,
                                dp_size=self.world.dp_size, reference=self.reference, after_forward=forward_done,
                                **totals)

    def _publish_phase(self, step: int, record: dict) -> None:
        # The gradients are dead once the optimizer has stepped: they sleep now, and the optimizer
        # state's copy to host (where it is offloaded) starts on the copy stream, so it overlaps the
        # publish; the step ends by waiting for it (finish_offload).
        switch = time.perf_counter()
        if self.config.memory_phases:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # activations' cached blocks go back before the KV cache wakes
            self.memory.sleep_for_generation()
        record["phase_switch_s"] += time.perf_counter() - switch
        with self.timeline.span("publish", step=step) as span:
            result = self.engine.publish()
            self.residency.sample("publish", record)
        self._unsafe_to_save = False
        record["publish_s"] = span["seconds"]
        record["publish_bytes_copied"] = result.bytes_copied
        self.timeline.counter("resident_bytes", self.residency.resident())

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy pass@1 on the eval dataset: one completion per row at temperature 0, each reward
        function's mean over the rows it scored ({"eval/<name>": mean}); the rows are split over the
        data-parallel ranks. Runs between steps, with the weights of the step just finished."""
        return greedy_pass_at_1(self.engine, self.eval_task, self.config.max_new_tokens, self.world, self.timeline,
                                self.step)

    # -- the run -----------------------------------------------------------------------------------
    def run(self, steps: int, progress: bool = True) -> list[dict]:
        """Train until `steps` steps are done in total (a resumed run counts the steps already done)."""
        check_int(steps, "steps")
        records = []
        bar = ProgressBar(steps, self.step, enabled=progress and self.world.is_main)
        terminate = TerminationRequest()
        try:
            while self.step < steps:
                record = self.train_step()
                self.log.write(record)
                if self.trackers is not None:
                    self.trackers.log(record)
                if self.skipped_in_a_row >= self.config.max_skipped_steps:
                    raise NonFiniteGradients(
                        f"step {self.step}: the gradient norm was {record['grad_norm']} for {self.skipped_in_a_row} "
                        f"step(s) in a row (max_skipped_steps={self.config.max_skipped_steps}); those steps left the "
                        "weights as they were" + (f", and the last checkpoint in {self.out_dir} is intact"
                                                  if self.out_dir else ""))
                records.append(record)
                bar.update(record)
                if self.config.save_every and self.step % self.config.save_every == 0:
                    self.save()
                if self.out_dir is not None and self.config.save_model_every and \
                        self.step % self.config.save_model_every == 0:
                    self.checkpointer.save_model(model_step_dir(self.out_dir, self.step))
                # Decided together, so every rank stops after the same step.
                if distributed.sum_floats([float(terminate.requested)], self.world)[0]:
                    self.save()
                    raise Terminated(f"stopped by SIGTERM after step {self.step}; it is checkpointed in "
                                     f"{self.out_dir}" if self.out_dir else f"stopped by SIGTERM after step {self.step}")
            self.save()
            if self.out_dir is not None:
                self.checkpointer.save_model(self.out_dir / FINAL)
        except BaseException as e:
            # A failure before the optimizer touched the weights leaves the last finished step intact:
            # keep it, so --resume loses nothing. Saving is collective, so with several ranks only
            # for the failures every rank raises together. Steps skipped for non-finite gradients
            # are not saved: the last checkpoint stays the newest, from before them.
            together = self.world.size == 1 or isinstance(e, (EngineFailure, ModelSaveError))
            skipped = isinstance(e, NonFiniteGradients)
            if not self._unsafe_to_save and self.out_dir is not None and together and not skipped:
                with contextlib.suppress(Exception):
                    self.save()
            raise
        finally:
            terminate.restore()
            bar.close()
        return records

    def save(self) -> Path | None:
        """Write a checkpoint of the finished steps (all ranks call it; rank 0 writes)."""
        return self.checkpointer.save(self.step)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        self.timeline.close()
        self.engine.close()
        if self._workdir is not None:
            self._workdir.cleanup()


def _out_of_memory(error) -> bool:
    """A device or pool out-of-memory error (torch's, colo's or Python's MemoryError)."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError))
