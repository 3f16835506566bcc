"""The knobs of a GRPO run, checked once up front so a bad value fails before any engine starts.

There is deliberately no memory-fraction knob: the KV cache gets what the weights and the regions
awake during generation leave of the pool; the training memory asleep then lends it its bytes
(see scheduler.py and colo.Pool).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..checks import check_int
from .schedules import SCHEDULES
from .trackers import check_report_to


DTYPES = ("bf16", "fp32")
# TRL's loss types (colo.grpo.loss: the per-token objective and how token losses are averaged).
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo", "vespo")
SCALES = ("group", "batch", "none")           # what advantages are divided by (colo.grpo.loss)
OVERLAP_MODES = ("auto", "on", "off")         # training during generation (colo.grpo.overlap)
# Importance sampling against the engine's log-probabilities (colo.grpo.loss; TRL's modes).
IMPORTANCE_SAMPLING = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# What --save-dtype takes (colo.grpo.export turns the name into a torch dtype).
SAVE_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


TOOL_ISOLATION = ("process", "thread")

@dataclass
class GRPOConfig:
    prompts_per_step: int = 8          # over all ranks; each rank generates its share (as even as possible)
    num_generations: int = 8           # completions per prompt (the GRPO group size)
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # sample from the k likeliest tokens (0: all)
    # TRL's names: min_p sampling (None: off), the repetition penalty (1.0: off), and more of vLLM's
    # SamplingParams fields for every generation (generation_kwargs; colo's own fields win).
    # TRL's log_completions: each step's sampled completions (the first num_completions_to_print; None:
    # all of the main rank's) with their rewards and advantages, to OUT/completions.jsonl and the trackers.
    log_completions: bool = False
    num_completions_to_print: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None
    ignore_eos: bool = False           # toy task: fixed-length completions
    # Completions that hit max_new_tokens (truncated, counted in the record's clipped_ratio) are left
    # out of the loss (DAPO's overlong filtering; TRL's mask_truncated_completions).
    mask_truncated: bool = False
    # Prompts longer than this many tokens: refused, naming the row, or with truncate_prompts="left"
    # cut to their last max_prompt_length tokens. None: only prompt + completion must fit the model.
    max_prompt_length: int | None = None
    truncate_prompts: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    eval_every: int = 0                # steps between greedy pass@1 evaluations on an eval dataset (0: none)
    eval_on_start: bool = False        # TRL's name: evaluate once before the first step (logged as step 0)
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 0              # linear learning-rate warm-up, then the schedule
    # TRL's names: the schedule after warm-up ("constant", "linear" or "cosine" to 0 at max_steps; TRL's
    # default is "linear", colo's "constant": a run's length is not always known up front), the warm-up
    # as a fraction of max_steps (warmup_steps wins), AdamW's epsilon; max_steps: the run's optimizer
    # steps (colo.grpo's CLI sets it from --steps x num_iterations).
    lr_scheduler_type: str = "constant"
    warmup_ratio: float = 0.0
    max_steps: int | None = None
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0  # None: no clipping
    # A step whose gradient norm is not finite skips its optimizer step (the weights stay as they were);
    # this many such steps in a row stop the run (colo.errors.NonFiniteGradients).
    max_skipped_steps: int = 3
    epsilon_low: float = 0.2           # PPO clip range below and above ratio 1
    epsilon_high: float = 0.2
    beta: float = 0.0                  # KL-to-reference weight; > 0 keeps a frozen reference copy
    # Advantages divided by the std of the group ("group", or True), of the whole batch ("batch"), or
    # not at all ("none", or False: Dr. GRPO). TRL's scale_rewards.
    scale_rewards: str = "group"
    # TRL's loss_type: the per-token objective (the clipped ratio; "cispo", "sapo") and how token losses
    # are averaged: "grpo" each sequence's mean, then the mean over sequences; "dapo" (TRL's default) the
    # mean over every token of the batch; "dr_grpo" the sum over sequences x max_new_tokens; the rest as
    # colo.grpo.loss.loss_denominators says.
    loss_type: str = "dapo"
    # TRL's names and defaults: ratios per token or per sequence ("sequence": GSPO); two-sided clipping
    # (the unclipped ratio capped at delta, None: off); the KL term times the ratio; SAPO's temperatures.
    importance_sampling_level: str = "token"
    # TRL's num_iterations (mu): optimizer steps per rollout; the later ones clip against the trainer's
    # log-probabilities at the weights the rollout was sampled with (a forward without gradients first, as TRL).
    num_iterations: int = 1
    # TRL's steps_per_generation: one rollout (prompts_per_step prompts) trained as this many slices of
    # its groups, an optimizer step each; every rank's share needs at least that many groups.
    steps_per_generation: int = 1
    # DAPO's dynamic sampling (colo.grpo.dynamic_sampling): groups whose rewards are all equal are dropped
    # and replaced by new prompts' groups, up to this many extra generations per step (0: off).
    dynamic_sampling: int = 0
    # TRL's multi_objective_aggregation: "sum_then_normalize" (the weighted sum of the rewards, then the
    # group's normalization) or "normalize_then_sum" (GDPO: each function normalized in its group, the
    # weighted sum normalized over the whole batch; scale_rewards then does not apply).
    multi_objective_aggregation: str = "sum_then_normalize"
    # TRL's top_entropy_quantile: the policy term counts only the tokens whose entropy is in the top
    # fraction of a micro-batch's (1.0: every token); the KL term keeps them all.
    top_entropy_quantile: float = 1.0
    delta: float | None = None
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0               # VESPO's gamma weights (TRL's names and defaults)
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # TRL's gradient_checkpointing: recompute each decoder layer's activations in backward instead of
    # keeping them (transformers' gradient_checkpointing_enable, non-reentrant). None: on a GPU, where
    # activations bound the completion length, off on a CPU (colo.grpo.config.checkpointing_on).
    gradient_checkpointing: bool | None = None
    micro_batch_size: int | None = None  # sequences per forward/backward; None: rows of similar length, 4096 positions at most
    memory_phases: bool = True         # KV cache asleep while training, gradients asleep while generating
    # Train each prompt's group while the engine decodes the others' (colo.grpo.overlap): "on", "off",
    # or "auto" (on where it measured faster on this device kind). Exactly on-policy either way.
    overlap: str = "auto"
    # CPU: the engine's and the trainer's threads while both have work during an overlapped step (the
    # groups left when generation ends train with every thread). None: half the cores each (overlap.cpu_split).
    overlap_threads: tuple[int, int] | None = None
    # Optimizer state to host memory while generating. None: only where the pool cannot hold it beside
    # the engine's weights and KV cache (TrainingMemory.must_offload); otherwise the copies would cost
    # time for nothing (on a host pool the "host copy" is even the same RAM).
    offload_optimizer: bool | None = None
    # The dtype of the weights the engine serves and the trainer shares: "bf16" (fp32 master weights
    # and AdamW moments with the optimizer, fp32 gradient accumulation) or "fp32". None: the one that
    # makes a whole step fastest on this device (resolve_dtype), decided when the run starts.
    dtype: str | None = None
    # ZeRO-1: each rank keeps 1/world of the fp32 master weights and AdamW moments; gradients are
    # reduce-scattered to their shard and the updated weights all-gathered into the engine's weights.
    shard_optimizer: bool = False
    # LoRA (colo.lora): > 0 trains an adapter of this rank on the frozen base instead of every weight;
    # the adapter is the engine's adapter slot (vLLM's native LoRA), the base the engine's weights.
    lora_rank: int = 0
    lora_alpha: float = 8.0            # PEFT's lora_alpha (scaling alpha / rank)
    lora_targets: tuple[str, ...] | None = None  # the linear layers adapted; None: colo.lora's default (all)
    # Routing replay (colo.moe_routing), MoE models only: the trainer routes each token to the experts the
    # engine routed it to when it sampled, its gate weights computed from its own router logits for
    # them. Off, the step record still says how often the two routings differ (router_mismatch).
    routing_replay: bool = False
    # Vision-language models (colo.grpo.images): the vision tower is frozen (shared, not trained) unless
    # train_vision; the projector and the language model train.
    train_vision: bool = False
    # Tensor parallelism (colo.tensor_parallel): ranks per engine; each holds only its shards, views of
    # its engine's. The torchrun world is world / tensor_parallel data-parallel groups of it.
    tensor_parallel: int = 1
    save_every: int = 10               # checkpoint period in steps (0: only at the end)
    # The model in Hugging Face format (colo.grpo.export): OUT/final at the end of every run, and
    # OUT/model-step-N every save_model_every steps (0: only the final one); in save_dtype (None: the
    # base model's own); with LoRA the PEFT adapter, and merge_lora adds the merged model.
    save_model_every: int = 0
    save_dtype: str | None = None
    merge_lora: bool = False
    # Experiment trackers that get every step record with the run's config (colo.grpo.trackers; TRL's
    # report_to names: "tensorboard", "wandb", "trackio", "all", "none"), under run_name (None: the
    # out_dir's name).
    report_to: tuple[str, ...] = ()
    run_name: str | None = None
    keep_checkpoints: int = 2          # newest ones kept (0: all)
    seed: int = 0
    # Agentic rollouts (colo.grpo.agent; the scheduler's tools= and environment_factory=): the most rounds
    # of tool calls in a rollout (TRL's max_tool_calling_iterations) and the seconds a tool call may take
    # (None: no limit). max_new_tokens bounds every turn's tokens together, the tools' results included.
    max_turns: int = 5
    tool_timeout: float | None = 30.0
    # Where sync tools run: "process" (worker processes, colo.grpo.tool_workers: a tool that crashes, hangs
    # or exhausts its memory ends its worker, not the run; its cost per call: bench section tool_calls) or
    # "thread" (daemon threads of the training process, as TRL runs them). Environments and async tools
    # run in the training process either way.
    tool_isolation: str = "process"
    # A chat template instead of the model's own: a .jinja file, or one TRL ships by name (e.g. "qwen2_5",
    # which describes tools and is ChatML like SmolLM2's own).
    chat_template: str | None = None
    # Importance sampling against the engine's log-probabilities (TRL's vllm_importance_sampling_*): a
    # mode of IMPORTANCE_SAMPLING, and the ratio's cap and floor (None: none; TRL's defaults 3.0, None).
    importance_sampling: str = "off"
    importance_sampling_max: float | None = 3.0
    importance_sampling_min: float | None = None
    # Guided decoding: every turn's text must match this regular expression (TRL's
    # vllm_structured_outputs_regex; e.g. to make a small model write well-formed tool calls in a test).
    structured_outputs_regex: str | None = None

    def __post_init__(self):
        self.adam_betas = tuple(self.adam_betas)
        for name in ("prompts_per_step", "num_generations", "max_new_tokens"):
            check_int(getattr(self, name), name)
        check_int(self.max_skipped_steps, "max_skipped_steps")
        for name in ("warmup_steps", "save_every", "save_model_every", "keep_checkpoints", "seed", "top_k",
                     "eval_every"):
            check_int(getattr(self, name), name, 0)
        if self.micro_batch_size is not None:
            check_int(self.micro_batch_size, "micro_batch_size")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.generation_kwargs is not None:
            check_generation_kwargs(self.generation_kwargs)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.structured_outputs_regex is not None:
            check_regex(self.structured_outputs_regex)
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"lr_scheduler_type must be one of {', '.join(SCHEDULES)}, got {self.lr_scheduler_type!r}")
        if self.max_steps is not None:
            check_int(self.max_steps, "max_steps")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if (self.lr_scheduler_type != "constant" or self.warmup_ratio) and self.max_steps is None:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r} / warmup_ratio={self.warmup_ratio} need "
                             "max_steps (the run's optimizer steps)")
        if not (0 <= self.adam_betas[0] < 1 and 0 <= self.adam_betas[1] < 1 and self.adam_epsilon > 0):
            raise ValueError(f"adam_betas must be in [0, 1) and adam_epsilon > 0, got {self.adam_betas}, "
                             f"{self.adam_epsilon}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if not (0 <= self.epsilon_low < 1 and self.epsilon_high >= 0):
            raise ValueError(f"clip range needs 0 <= epsilon_low < 1 and epsilon_high >= 0, "
                             f"got {self.epsilon_low}, {self.epsilon_high}")
        if self.offload_optimizer not in (None, True, False):
            raise ValueError(f"offload_optimizer must be True, False or None (where the pool needs it), got "
                             f"{self.offload_optimizer!r}")
        if not isinstance(self.shard_optimizer, bool):
            raise ValueError(f"shard_optimizer must be True or False, got {self.shard_optimizer!r}")
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.scale_rewards not in SCALES:
            raise ValueError(f"scale_rewards must be one of {', '.join(SCALES)}, got {self.scale_rewards!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap!r}")
        if self.overlap_threads is not None:
            if not isinstance(self.overlap_threads, (tuple, list)) or len(self.overlap_threads) != 2:
                raise ValueError(f"overlap_threads must be (engine threads, trainer threads), got {self.overlap_threads!r}")
            self.overlap_threads = tuple(check_int(n, "overlap_threads") for n in self.overlap_threads)
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        check_int(self.num_iterations, "num_iterations")
        check_int(self.steps_per_generation, "steps_per_generation")
        if self.steps_per_generation > self.prompts_per_step:
            raise ValueError(f"steps_per_generation={self.steps_per_generation} slices a rollout of "
                             f"{self.prompts_per_step} prompts' groups: at most prompts_per_step")
        if self.steps_per_generation > 1 and self.dynamic_sampling:
            raise NotImplementedError("steps_per_generation with dynamic_sampling (a step's groups vary in number)")
        if self.steps_per_generation > 1 and self.overlap == "on":
            raise ValueError(f"steps_per_generation={self.steps_per_generation} with overlap='on': the slices train "
                             "after the whole rollout is generated (overlap='auto' or 'off')")
        check_int(self.dynamic_sampling, "dynamic_sampling", 0)
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError("multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', got "
                             f"{self.multi_objective_aggregation!r}")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.overlap == "on":
            raise ValueError("multi_objective_aggregation='normalize_then_sum' normalizes over the whole batch: "
                             "it needs serial steps (overlap='auto' or 'off')")
        if self.dynamic_sampling and (self.overlap == "on" or self.tensor_parallel > 1):
            raise ValueError("dynamic_sampling generates again after scoring: it needs serial steps (overlap='auto' "
                             "or 'off') and one engine per rank (tensor_parallel=1)")
        if self.num_iterations > 1 and self.overlap == "on":
            raise ValueError(f"num_iterations={self.num_iterations} with overlap='on': a rollout trained on several "
                             "times is trained after its generation (overlap='auto' or 'off')")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level must be 'token' or 'sequence' (GSPO), got "
                             f"{self.importance_sampling_level!r}")
        if self.delta is not None and not self.delta > 1 + self.epsilon_high:
            raise ValueError(f"delta (two-sided clipping) must exceed 1 + epsilon_high = {1 + self.epsilon_high}, "
                             f"got {self.delta}")
        if not (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0):
            raise ValueError("sapo_temperature_pos and sapo_temperature_neg must be positive")
        if self.max_prompt_length is not None:
            check_int(self.max_prompt_length, "max_prompt_length")
        if self.truncate_prompts not in (None, "left"):
            raise ValueError(f"truncate_prompts must be None or 'left', got {self.truncate_prompts!r}")
        if self.truncate_prompts and self.max_prompt_length is None:
            raise ValueError("truncate_prompts='left' needs max_prompt_length (the tokens to keep)")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {self.chat_template_kwargs!r}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        check_int(self.lora_rank, "lora_rank", 0)
        if self.lora_targets is not None:
            self.lora_targets = (self.lora_targets,) if isinstance(self.lora_targets, str) else tuple(self.lora_targets)
        if self.lora_rank:
            self.lora_spec  # noqa: B018 - validates rank, alpha and targets
            if self.shard_optimizer:
                raise ValueError("shard_optimizer with lora_rank > 0: an adapter's optimizer state is small; "
                                 "train it unsharded")
        check_int(self.tensor_parallel, "tensor_parallel")
        if self.tensor_parallel > 1 and self.beta > 0:
            raise NotImplementedError(f"tensor_parallel={self.tensor_parallel} with beta > 0 (a reference model) is "
                                      "not built yet")
        if self.tensor_parallel > 1 and (self.eval_every or self.eval_on_start):
            raise NotImplementedError("evaluation (eval_every, eval_on_start) with tensor_parallel > 1 is not built yet")
        if self.save_dtype is not None and str(self.save_dtype).lower() not in SAVE_DTYPES:
            raise ValueError(f"save_dtype: {self.save_dtype!r} is not a dtype colo saves in; one of bf16, fp16, fp32 "
                             "or None (the base model's own)")
        self.report_to = check_report_to([self.report_to] if isinstance(self.report_to, str) else self.report_to)
        if self.merge_lora and not self.lora_rank:
            raise ValueError("merge_lora needs lora_rank > 0 (full fine-tuning saves the whole model already)")
        check_int(self.max_turns, "max_turns", 0)
        if self.tool_isolation not in TOOL_ISOLATION:
            raise ValueError(f"tool_isolation must be one of {', '.join(TOOL_ISOLATION)}, got {self.tool_isolation!r}")
        if self.tool_timeout is not None and not self.tool_timeout > 0:
            raise ValueError(f"tool_timeout must be > 0 seconds or None, got {self.tool_timeout}")
        if self.importance_sampling not in IMPORTANCE_SAMPLING:
            raise ValueError(f"importance_sampling must be one of {', '.join(IMPORTANCE_SAMPLING)}, got "
                             f"{self.importance_sampling!r}")
        low, high = self.importance_sampling_min, self.importance_sampling_max
        if self.importance_sampling.endswith("truncate") and low is None and high is None:
            raise ValueError(f"importance_sampling={self.importance_sampling!r} needs importance_sampling_max or _min")
        if low is not None and high is not None and not low < high:
            raise ValueError(f"importance_sampling_min ({low}) must be below importance_sampling_max ({high})")
        if self.dtype not in (None, *DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or None (the fastest here), got {self.dtype!r}")

    @property
    def lora_spec(self):
        """The colo.lora.LoraSpec of the adapter to train, or None (lora_rank 0: full fine-tuning)."""
        if not self.lora_rank:
            return None
        from ..lora import LoraSpec  # here, not at the top: colo.lora imports vLLM's compatibility layer

        targets = {} if self.lora_targets is None else {"targets": self.lora_targets}
        return LoraSpec(self.lora_rank, self.lora_alpha, **targets)

    @property
    def torch_dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]

    def resolve_dtype(self, device="cpu") -> "GRPOConfig":
        """This config with `dtype` decided: as given, or the one that makes a whole step fastest on
        `device` (colo.dtype_choice.fastest_dtype: bf16 where the device computes in bf16 natively)."""
        if self.dtype is not None:
            return self
        from ..dtype_choice import fastest_dtype

        return dataclasses.replace(self, dtype=fastest_dtype(device).name)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        d["lora_targets"] = None if self.lora_targets is None else list(self.lora_targets)
        d["report_to"] = list(self.report_to)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GRPOConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def check_model_dir(model_dir, tensor_parallel: int = 1) -> None:
    """Refuse what colo cannot train before any engine starts (the CLI and the scheduler both ask):
    no Hugging Face model there (FileNotFoundError), an unreadable config.json (ValueError), a model
    that is not a decoder-only causal LM (a vision-language model, an encoder: NotImplementedError), a
    config that contradicts itself, or a model `tensor_parallel` ranks cannot split (ValueError, naming
    it). Whether its weights are shared or copied is decided when the engine is up, from its layout."""
    from pathlib import Path

    from transformers import AutoConfig

    from ..shared import check_model_config

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face model at {model_dir} (config.json missing)")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    check_model_config(config)
    if tensor_parallel > 1:
        from ..tensor_parallel import check_shardable

        check_shardable(config, tensor_parallel)



# SamplingParams fields colo sets itself (per request, or from its own settings).
OWN_SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop_token_ids",
                       "ignore_eos", "logit_bias", "min_p", "repetition_penalty", "output_kind", "structured_outputs")


def check_generation_kwargs(kwargs: dict) -> None:
    """generation_kwargs: names of vLLM's SamplingParams, none of the fields colo sets (a clear error,
    naming the closest field, before any engine starts)."""
    import difflib
    import inspect

    if not isinstance(kwargs, dict):
        raise ValueError(f"generation_kwargs must be a mapping of vLLM SamplingParams fields, got {kwargs!r}")
    from vllm import SamplingParams

    known = set(inspect.signature(SamplingParams).parameters) | set(getattr(SamplingParams, "__struct_fields__", ()))
    for name in kwargs:
        if name in OWN_SAMPLING_FIELDS:
            raise ValueError(f"generation_kwargs[{name!r}]: colo sets {name} itself; use its own setting")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise ValueError(f"generation_kwargs[{name!r}] is not a field of vLLM's SamplingParams"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))


def checkpointing_on(config, device_type: str) -> bool:
    """Whether a run recomputes activations in backward: as asked, else on a GPU only."""
    return config.gradient_checkpointing if config.gradient_checkpointing is not None else device_type == "cuda"


def check_routing_replay(model_dir, agentic: bool) -> None:
    """Refuse routing_replay before any engine starts where it has nothing to replay (a dense model) or
    where colo does not follow the routes yet (agentic rollouts: each turn is a request of its own)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    experts = max(getattr(config, name, 0) or 0 for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    if experts <= 0:
        raise ValueError(f"routing_replay: {model_dir} is not a MoE model (its config names no experts); there is no "
                         "routing to replay")
    if agentic:
        raise NotImplementedError("routing_replay with agentic rollouts (tools, environments, rollout_func): colo does "
                                  "not carry the engine's routes across turns yet")


def check_regex(regex) -> None:
    """A guided-decoding regex that does not compile is the user's error, refused before any engine starts
    (vLLM would refuse every request at the first generation)."""
    import re

    if not isinstance(regex, str) or not regex:
        raise ValueError(f"structured_outputs_regex must be a non-empty string, got {regex!r}")
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"structured_outputs_regex {regex!r} is not a regular expression: {e}") from None
