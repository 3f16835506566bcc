"""The GRPO phase machine: generate, reward, train, publish, one device, one pool, one copy of the weights.

One step, as train_step() reads:

    generate  the KV cache awake; the whole rollout batch in one engine call (n completions per prompt)
    reward    the user's functions score every completion; advantages are normalised per prompt group
    train     the KV cache asleep (resident bytes 0); gradients awake; the optimizer state copied back
              on the copy stream while forward and backward run; gradients averaged over ranks and
              clipped (one rule, colo.clipping: a norm that is not finite skips the update); optimizer
              step (with shard_optimizer, ZeRO-1: gradients reduce-scattered to their shard's rank,
              each rank steps its shard and all-gathers the updated weights straight into the engine's)
    publish   the gradients released and the optimizer state's copy to host started where it is
              offloaded; the engine serves the new weights (no bytes copied when layouts match) while
              that copy runs; the KV cache wakes once it is done

Three objects keep the step short: `views` (colo.shared's contract: whole weights, tensor-parallel
shards or a LoRA adapter, all alike here), `phases` (colo.grpo.phases: the memory's two verbs,
to_train() and to_generate()) and `strategy` (colo.grpo.strategy: serial, or each group trained while
the engine decodes the others, chosen once per run). Each phase returns what it did, and the step
builds its record at the end.

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
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from .. import vllm_compat as compat
from ..checks import check_int
from ..errors import ModelSaveError, NonFiniteGradients, Terminated
from ..hf_format import FINAL, model_step_dir
from ..model_classes import disable_dropout, vision_tower_parameters
from ..moe_routing import RouterReplay, is_moe
from ..pool import Pool
from ..regions import WEIGHTS
from ..zero import ShardLayout
from . import distributed
from .backward import PolicyTrainer
from .batch import rollout_of
from .checkpoint import Checkpointer
from .config import GRPOConfig, check_routing_replay, checkpointing_on, processed_logprobs
from .metrics import ProgressBar, Residency, StepLog, Timeline, rank_path, scored_mean_std
from .overlap import memory_refusal, serial_reason
from .phases import MemoryPhases
from .preflight import CheckedRun, check_run
from .completions_log import completion_samples
from .reward_model import attach_reward_models
from .schedules import lr_multiplier, warmup_of
from .rollout_engine import EngineFailure, RolloutEngine
from .strategy import OverlappedSteps, Scored, SerialSteps
from .task import Task, build_tasks, fit_model_length, guided_options, longest_sequence, rank_batch, stop_options
from .trackers import Trackers
from .train_memory import TrainingMemory
from .update import Updater, Updates

logger = logging.getLogger(__name__)

PromptFn = Callable[[int, int], list]          # (step, count) -> list of prompts (token id lists)
RewardFn = Callable[[list, list], list]        # (prompts, completions) -> one float per completion


class GRPOScheduler:
    """Runs GRPO steps on `model_dir` (a Hugging Face causal LM directory, or a hub id ORG/NAME: colo.hub)
    colocated with a vLLM engine.

    What it trains on, one of:
    - dataset + reward_funcs (TRL's conventions; colo.grpo.task.DatasetTask): a `datasets.Dataset`, a
      list of row dicts, or a file/directory path with a `prompt` column (text, or messages through the
      model's chat template), reward functions f(prompts, completions, completion_ids, **columns) or their
      names (colo.grpo.rewards), reward_weights; eval_dataset for greedy pass@1 every config.eval_every
      steps.
    - prompt_fn + reward_fn, token ids only: prompt_fn(step, count) returns `count` prompts (lists of
      token ids) for a step; it must depend only on its arguments so a resumed run sees the same
      prompts. reward_fn(prompts, completions) returns one float per completion, prompts repeated once
      per completion.
    - task: a colo.grpo.task.Task.
    Agentic rollouts (colo.grpo.agent), with a dataset task, as TRL's GRPOTrainer takes them: tools (plain
    functions the model may call, described to it by the chat template), environment_factory (a class:
    one instance per rollout, reset(**row) before it, its public methods tools, get_reward() a reward),
    config.max_turns rounds of tool calls at most; or rollout_func(prompts, context) -> {"prompt_ids",
    "completion_ids", "logprobs", optional "env_mask", other fields for the reward functions}, which
    generates with the engine itself (context.llm).
    out_dir: where checkpoints go (None: no checkpoints), and the model in Hugging Face format: out_dir/final
    at the end, out_dir/model-step-N every config.save_model_every steps (colo.hf_format). resume=True
    continues from its latest checkpoint.
    pool_capacity: bytes of the device (or RAM) this run's pool may use; default: all that is free.
    The regions time-share it: the KV cache may use the bytes of the training memory that sleeps
    while generating (see colo.Pool).
    checked: colo.grpo.preflight.check_run's result for these model_dir, out_dir and resume (the CLI
    checks them itself, naming its flags, and hands this on); None: they are checked here, before
    anything is built.
    """

    def __init__(self, model_dir: str | Path, reward_fn: RewardFn | None = None, prompt_fn: PromptFn | None = None,
                 config: GRPOConfig | None = None, *, dataset=None, reward_funcs=None, reward_weights=None,
                 eval_dataset=None, tokenizer=None, task: Task | None = None, out_dir: str | Path | None = None,
                 log_path: str | Path | None = None, trace_path: str | Path | None = None,
                 resume: bool = False, engine_options: dict | None = None, pool_capacity: int | None = None,
                 tools=None, environment_factory=None, rollout_func=None, checked: CheckedRun | None = None):
        self.config = config or GRPOConfig()
        checked = checked or check_run(model_dir, self.config, out_dir=out_dir, resume=resume)
        self.model_dir, self.out_dir = checked.model_dir, checked.out_dir
        resume = checked.resume_from is not None
        self.tools, self.environment_factory, self.rollout_func = list(tools or ()), environment_factory, rollout_func
        self._check_agentic()
        self.task, self.eval_task = build_tasks(self.config, self.model_dir, task, dataset, reward_funcs,
                                                reward_weights, eval_dataset, tokenizer, prompt_fn, reward_fn,
                                                tools=self.tools, environment=environment_factory)
        if getattr(self.task, "image_column", None) and self.config.tensor_parallel > 1:
            raise NotImplementedError(
                "images (a vision-language model's prompts) with tensor_parallel > 1: colo's tensor-parallel trainer "
                "is the language model's shards and takes token ids alone, while vLLM shards the vision tower over "
                "the ranks too, as no transformers tower runs; train it on one device per engine (ZeRO-1, "
                "--shard-optimizer, shards the optimizer state instead; docs/vision.md)")
        engine_options = self._engine_options(engine_options)
        self._join_world()
        # Tool workers before the engine: no worker process is made from one holding vLLM's threads.
        self.tool_workers = start_tool_workers(self.tools, self.config.tool_isolation)
        resume_state = Checkpointer.resume_state(checked.resume_from, self.config, self.world) if resume else None
        torch.manual_seed(self.config.seed + self.world.dp_rank)  # an engine's tensor-parallel ranks alike
        self.pool = Pool(self.device, capacity=pool_capacity)
        self.residency = Residency(self.pool, self.device)
        self.config = self.config.resolve_dtype(self.device, self.world)
        self.sequence_tokens = longest_sequence(self.config, self.task)  # may ask the task for step 1's prompts
        self._start_engine(engine_options or {})
        self.agent, self.eval_agent = self._agents()
        self._build_training()
        # Reward models' weights sleep in the pool between scorings (colo.grpo.reward_model).
        attach_reward_models(getattr(self.task, "reward_funcs", ()), self.pool)
        self.serial_reason = self._overlap_refusal()  # None: each step trains finished groups while generating
        self.strategy = self._strategy()
        self.timeline = Timeline(rank_path(trace_path, self.world.rank), rank=self.world.rank, append=resume)
        self.checkpointer = Checkpointer(self.out_dir, self.config, self.world, self.model_dir, views=self.views,
                                         phases=self.phases, memory=self.memory, optimizer=self.optimizer,
                                         lr_scheduler=self.lr_scheduler, reference=self.reference,
                                         timeline=self.timeline)
        self.step = self.checkpointer.restore(resume_state) if resume_state is not None else 0
        # The optimizer steps taken so far, each step's as many (TRL's global_step: sync_ref_model's clock).
        self.updater.optimizer_steps = self.step * self.config.num_iterations * self.config.steps_per_generation
        self.log = StepLog(log_path if self.world.is_main else None,
                           resume_after_step=self.step if resume else None)
        self.trackers = self._open_trackers(log_path, resume) if self.world.is_main else None
        # TRL's log_completions: OUT/completions.jsonl (beside the step log without an OUT).
        where = self.out_dir or (Path(log_path).parent if log_path else None)
        self.completions_log = StepLog(where / "completions.jsonl" if where and self.config.log_completions and
                                       self.world.is_main else None, resume_after_step=self.step if resume else None)
        self.last_completions: list[dict] = []   # the last step's samples (log_completions), for library users

    # -- set-up ------------------------------------------------------------------------------------
    def _check_agentic(self) -> None:
        """Agentic rollouts' own refusals, before anything is built."""
        agentic = bool(self.tools or self.environment_factory is not None or self.rollout_func is not None)
        if self.rollout_func is not None and (self.tools or self.environment_factory is not None):
            raise ValueError("rollout_func generates the rollouts itself: give it, or tools / environment_factory")
        if self.rollout_func is not None and not callable(self.rollout_func):
            raise ValueError(f"rollout_func must be a function (prompts, context) -> dict, got {self.rollout_func!r}")
        if self.config.routing_replay:
            check_routing_replay(self.model_dir, agentic=agentic)
        if agentic and self.config.tensor_parallel > 1:
            # The ranks of a tensor-parallel engine step together; tools returning at different moments on
            # each rank would queue different turns on them.
            raise NotImplementedError("agentic rollouts (tools, environments, rollout_func) with tensor_parallel > 1")

    def _engine_options(self, engine_options: dict | None) -> dict:
        """The user's engine options, with what the run's settings need of vLLM."""
        engine_options = fit_model_length(self.config, self.model_dir, (self.task, self.eval_task),
                                          dict(engine_options or {}))
        if processed_logprobs(self.config):  # the log-probabilities of what the engine sampled from
            engine_options.setdefault("logprobs_mode", "processed_logprobs")
        if self.config.structured_outputs_regex:  # vLLM's guided decoding reads the vocabulary from the tokenizer
            engine_options["skip_tokenizer_init"] = False
        if self.config.routing_replay:  # every position routed by the engine, and said so
            engine_options.update(compat.engine_routing_options("cuda" if torch.cuda.is_available() else "cpu"))
        return engine_options

    def _join_world(self) -> None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        # on a GPU also makes this rank's device current
        self.world = distributed.init_world(device_type, self.config.tensor_parallel)
        self.device = torch.device("cuda", self.world.local_rank) if device_type == "cuda" else torch.device("cpu")
        if self.config.prompts_per_step < self.world.dp_size:
            raise ValueError(f"prompts_per_step={self.config.prompts_per_step} leaves ranks without prompts: "
                             f"it must be at least the number of data-parallel ranks ({self.world.dp_size})")

    def _attend_images_as_the_engine(self) -> None:
        """Where the engine attends causally among an image's tokens and transformers both ways (Gemma 3
        on vLLM's CPU backend), the trainer attends as the engine does: it trains on what was sampled."""
        if not compat.image_attention_is_causal(self.engine.llm):
            return
        for task in (self.task, self.eval_task):
            if getattr(task, "image_prompts", None) is not None:
                task.image_prompts.causal_images = True
        logger.warning("%s: this engine attends causally among an image's tokens, where transformers attends "
                       "both ways (vLLM's backend here has no bidirectional image attention); the trainer "
                       "attends as the engine does, so training is on-policy, and OUT/final attends both ways "
                       "again where it is served", self.model_dir)

    def _start_engine(self, engine_options: dict) -> None:
        """The engine first: vLLM loads the weights into the pool, and the trainer's model is a view of them."""
        lora = self.config.lora_spec
        # The zero adapter the engine loads once at start (one directory per rank: no shared writes).
        self._workdir = tempfile.TemporaryDirectory(prefix="colo-grpo-") if lora else None
        self.engine = RolloutEngine(self.model_dir, self.pool, seed=self.config.seed, dtype=self.config.torch_dtype,
                                    max_num_seqs=self._sequences_per_rank(),
                                    sequence_tokens=self.sequence_tokens, lora=lora,
                                    workdir=self._workdir.name if lora else None,
                                    tensor_parallel=self.config.tensor_parallel,
                                    share_check=self.config.share_check, **engine_options)
        refusal = compat.decode_refusal(self.engine.llm)  # a run generates: said before anything trains
        if refusal is not None:
            raise NotImplementedError(f"{self.model_dir}: {refusal}")
        self._attend_images_as_the_engine()
        self.views = self.engine.views  # what the optimizer trains, whichever kind (colo.shared)
        self.model = self.engine.hf_model
        if is_moe(self.model):  # the routing the engine sampled with: replayed, or compared (router_mismatch)
            RouterReplay.attach(self.model)
        if self.config.disable_dropout:
            disable_dropout(self.model)
        if checkpointing_on(self.config, self.device.type) and hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.config.train_vision and not self.config.lora_spec:  # still served, from the same tensors
            for parameter in vision_tower_parameters(self.model):
                parameter.requires_grad_(False)
        # The KL term's reference: with an adapter the shared base itself (no copy), else a frozen copy.
        self.reference = self.views.reference() if self.config.beta > 0 else None

    def _agents(self):
        """The multi-turn rollouts of training and evaluation (colo.grpo.agent; None, None: single turns)."""
        from .agent import AgentRollouts, CustomRollouts

        if self.rollout_func is not None:
            return CustomRollouts(self.engine, self.task, self.rollout_func, self.config), None
        if not self.tools and self.environment_factory is None:
            return None, None
        options = dict(tools={t.__name__: t for t in self.tools}, environment=self.environment_factory,
                       max_turns=self.config.max_turns, tool_timeout=self.config.tool_timeout, workers=self.tool_workers,
                       max_new_tokens=self.config.max_new_tokens, max_model_len=self.engine.max_model_len)
        evaluation = AgentRollouts(self.engine, self.eval_task, **options) if self.eval_task is not None else None
        return AgentRollouts(self.engine, self.task, **options), evaluation

    def _build_training(self) -> None:
        """Gradients, optimizer state and the optimizer, with exact budgets in the pool."""
        cfg = self.config
        # Every rank takes as many optimizer steps: each share must hold a group per slice.
        smallest = len(distributed.rank_share(cfg.prompts_per_step, self.world, rank=self.world.dp_size - 1))
        if cfg.steps_per_generation > smallest:
            raise ValueError(f"steps_per_generation={cfg.steps_per_generation}: a data-parallel rank's share of "
                             f"{cfg.prompts_per_step} prompts is {smallest} groups, one per slice at least")
        params = self.views.parameters()
        # The training memory gets its budgets beside the weights while the KV cache sleeps (they
        # time-share the pool); the run then starts ready to generate.
        if cfg.memory_phases:
            self.engine.sleep_kv_cache()
        # ZeRO-1: this rank's shard of masters and moments; the all-gather lands in the engine's weights.
        # With tensor parallelism, over the data-parallel ranks (those holding the same shards).
        shard = ShardLayout(params, self.world.dp_size, self.world.dp_rank, store_region=self.pool.regions[WEIGHTS]) \
            if cfg.shard_optimizer else None
        self.memory = TrainingMemory(self.pool, params, offload_optimizer=cfg.offload_optimizer, shard=shard,
                                     shard_group=self.world.dp_group, scales=self.views.scales())
        # fp32 parameters: AdamW itself; bf16: a colo.MasterWeightOptimizer stepping fp32 masters in the
        # optimizer region; sharded: a colo.ShardedMasterWeightOptimizer.
        # (every data-parallel rank rounds its replica alike: the same seed; ZeRO-1's ranks their own shards)
        # torch's fused AdamW, as TRL's Trainer steps (transformers' adamw_torch_fused default): one kernel
        # per tensor on a CPU as on a GPU (bench/results/cpu-adamw-fused-zen5.json).
        self.optimizer = self.memory.build_optimizer(torch.optim.AdamW, rounding=cfg.master_rounding,
                                                     seed=cfg.seed, lr=cfg.learning_rate,
                                                     betas=cfg.adam_betas, eps=cfg.adam_epsilon,
                                                     weight_decay=cfg.weight_decay, fused=True)
        warmup = warmup_of(cfg.warmup_steps, cfg.warmup_ratio, cfg.max_steps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            getattr(self.optimizer, "optimizer", self.optimizer),
            lambda i: lr_multiplier(i, cfg.lr_scheduler_type, warmup, cfg.max_steps))
        self.updater = Updater(self.memory, self.optimizer, self.lr_scheduler, views=self.views, world=self.world,
                               config=cfg, reference=self.reference, residency=self.residency)
        self.phases = MemoryPhases(self.engine, self.memory, on=cfg.memory_phases)
        self.phases.to_generate()
        self.phases.take_seconds()  # set-up, not a step's
        self.trainer = PolicyTrainer(self.views, cfg, device=self.device, dp_size=self.world.dp_size,
                                     reference=self.reference, residency=self.residency, phases=self.phases)

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
        if reason is None and self.rollout_func is not None:
            reason = "rollout_func returns the whole batch at once: no group finishes early"
        if reason is None and self.trainer.aux is not None:
            reason = (f"the MoE load-balancing loss (router_aux_loss_coef {self.trainer.aux.coef:g}) is a mean over "
                      "the step's rows, added where they train together")
        reason = reason or memory_refusal(self.memory, self.config, self.model_dir, self.sequence_tokens)
        if reason is not None:
            (logger.warning if self.config.overlap == "on" else logger.info)("serial GRPO steps: %s", reason)
        return reason

    def _strategy(self) -> SerialSteps:
        """Serial steps, or overlapped ones where nothing refuses them (chosen once: serial_reason)."""
        if self.serial_reason is not None:
            return SerialSteps(self.engine, self.task, self.config, self.world, self.trainer, memory=self.memory,
                               agent=self.agent)
        stream = self.pool.stream("train").torch_stream() if self.device.type == "cuda" else None
        return OverlappedSteps(self.engine, self.task, self.config, self.world, self.trainer, agent=self.agent,
                               phases=self.phases,
                               memory=self.memory, model_dir=self.model_dir, sequence_tokens=self.sequence_tokens,
                               device=self.device, train_stream=stream)

    def _sequences_per_rank(self) -> int:
        return len(distributed.rank_share(self.config.prompts_per_step, self.world, rank=0)) * self.config.num_generations

    # -- the step ----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Run one GRPO step (the next one) and return its metrics record."""
        step, started = self.step + 1, time.perf_counter()
        batch = rank_batch(self.task, self.config, self.world, step, self.engine)
        with self.timeline.span("generate", step=step) as generating:
            generated = self.strategy.generate_or_rebuild(step, batch, self.timeline)  # engine raised: rebuilt, once more
        with self.strategy.abandoned_on_failure(generated):
            with self.timeline.span("reward", step=step):
                scored = self.strategy.score(step, generated, self.timeline)
            with self.timeline.span("train", step=step) as training:
                self._to_train(gradients_awake=generated.overlapped is not None)
                updates = Updates(self.views, self.world)
                for part in self.strategy.parts(scored):  # one; TRL's steps_per_generation x num_iterations slices
                    trained = self.strategy.train(part, generated)  # forward, loss, backward (or the overlap's rest)
                    updates.add(trained, self.updater.clip_and_step())  # a norm that is not finite: no step
            self.last_completions = self._completion_samples(step, scored)
        self.phases.to_generate_begin()  # the gradients sleep; the optimizer state's copy out overlaps the publish
        report, publish_s = self._publish(step)
        self.phases.to_generate_end()  # the KV cache wakes: between steps the run is ready to generate
        self.step = step
        record = {"step": step, "dtype": self.config.dtype, "generate_s": generating["seconds"],
                  **generated.fields(self.world), **scored.fields(self.world), "train_s": training["seconds"],
                  **updates.fields(), "optimizer_state_bytes": self.memory.optimizer_state_bytes(),
                  "publish_s": publish_s, "publish_bytes_copied": report.bytes_copied,
                  "phase_switch_s": self.phases.take_seconds(), **self.residency.take(),
                  "step_s": time.perf_counter() - started, "lr": self.lr_scheduler.get_last_lr()[0]}
        record["tokens_per_s"] = record["tokens_generated"] / record["step_s"]
        if self.eval_task is not None and self.config.eval_every and step % self.config.eval_every == 0:
            record.update(self.evaluate())
        return record

    def _to_train(self, *, gradients_awake: bool) -> None:
        self.phases.to_train(gradients_awake=gradients_awake)
        self.timeline.counter("resident_bytes", self.residency.resident())

    def _completion_samples(self, step: int, scored: Scored) -> list[dict]:
        """TRL's log_completions: the step's first num_completions_to_print completions with their rewards and
        the advantages the step trained with (the strategy's: a collective with scale_rewards='batch', on
        every rank alike); the last step's samples where the run does not log them."""
        if not self.config.log_completions:
            return self.last_completions
        advantages = self.strategy.advantages(scored.scores, scored.rollout)
        return completion_samples(self.task, step, scored.rollout, scored.scores, advantages,
                                  self.config.num_completions_to_print)

    def _publish(self, step: int):
        """The engine serves the trainer's weights from now on: (colo.shared.PublishReport, seconds)."""
        with self.timeline.span("publish", step=step) as span:
            report = self.engine.publish()
            self.residency.sample("publish")
        self.updater.weights_changing = False
        self.timeline.counter("resident_bytes", self.residency.resident())
        return report, span["seconds"]

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy pass@1 on the eval dataset: one completion per row at temperature 0, each reward
        function's mean over the rows it scored ({"eval/<name>": mean}, and "eval_s"); the rows are split
        over the data-parallel ranks. Runs between steps, with the weights of the step just finished."""
        task, world = self.eval_task, self.world
        rows = list(distributed.rank_share(len(task.prompt_token_ids), world))
        prompts = [task.prompt_token_ids[r] for r in rows]
        record = {}
        with self.timeline.span("eval", step=self.step) as span:
            self.phases.to_generate()
            sampling = dict(n=1, max_tokens=self.config.max_new_tokens, temperature=0.0, **stop_options(task),
                            **guided_options(self.config))
            scores = None
            if prompts and self.eval_agent is not None:  # the tools run, turn by turn, as in training
                outputs = self.eval_agent.generate(rows, prompts, [sampling] * len(prompts))
                done = rollout_of(rows, prompts, outputs, 1)
                scores = task.score(self.step, rows, done.prompts, done.completions, **done.reward_inputs())
            elif prompts:
                outputs = self.engine.generate(prompts, [sampling] * len(prompts))
                scores = task.score(self.step, rows, prompts, [c.token_ids for c in outputs])
        for i, name in enumerate(task.reward_names):
            column = scores.per_function[:, i] if scores is not None else torch.empty(0)
            record[f"eval/{name}"] = scored_mean_std(column, world)[0]  # collective: every rank, rows or not
        record["eval_s"] = span["seconds"]
        self.phases.take_seconds()  # between steps, not a step's
        return record

    # -- the run -----------------------------------------------------------------------------------
    def run(self, steps: int, progress: bool = True, progress_file=None) -> list[dict]:
        """Train until `steps` steps are done in total (a resumed run counts the steps already done).
        progress_file: where the progress bar goes (default: stderr)."""
        check_int(steps, "steps")
        records = []
        bar = ProgressBar(steps, self.step, enabled=progress and self.world.is_main, file=progress_file)
        terminate = _TerminationRequest()
        if self.config.eval_on_start and self.eval_task is not None and self.step == 0:
            start = {"step": 0, **self.evaluate()}  # the base model's pass@1; not a step's record
            self.log.write(start)
            if self.trackers is not None:
                self.trackers.log(start)
        try:
            while self.step < steps:
                record = self.train_step()
                self.log.write(record)
                for sample in self.last_completions:
                    self.completions_log.write(sample)
                if self.trackers is not None:
                    self.trackers.log(record)
                    self.trackers.log_completions(record["step"], self.last_completions)
                if self.updater.skipped_in_a_row >= self.config.max_skipped_steps:
                    raise NonFiniteGradients(
                        f"step {self.step}: the gradient norm was {record['grad_norm']} for "
                        f"{self.updater.skipped_in_a_row} "
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
            if not self.updater.weights_changing and self.out_dir is not None and together and not skipped:
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
        for agent in (self.agent, self.eval_agent):
            if agent is not None:
                agent.close()
        if self.tool_workers is not None:
            self.tool_workers.close()
        if self.trackers is not None:
            self.trackers.close()
        self.timeline.close()
        self.engine.close()
        if self._workdir is not None:
            self._workdir.cleanup()


def start_tool_workers(tools: list, isolation: str):
    """The worker processes the run's sync tools run in (colo.grpo.tool_workers), or None (thread isolation,
    no sync tools)."""
    from .tool_workers import ToolWorkers
    from .tools import check_picklable, is_async_tool

    synchronous = {t.__name__: t for t in tools if not is_async_tool(t)}
    if not synchronous or isolation != "process":
        return None
    check_picklable(synchronous)   # named here, not a bare pickling error from the worker's start
    return ToolWorkers(synchronous)


class _TerminationRequest:
    """SIGTERM as a request to stop after the current step (the run checkpoints it and raises
    colo.errors.Terminated), instead of dying mid-step with the work since the last checkpoint lost.
    Installs its handler on the main thread only (elsewhere a no-op) until restore()."""

    def __init__(self):
        self.requested = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum, frame):
        self.requested = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
