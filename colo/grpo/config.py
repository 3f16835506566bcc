"""The knobs of a GRPO run, checked once up front so a bad value fails before any engine starts.

There is deliberately no memory-fraction knob: the KV cache gets what the weights and the regions
awake during generation leave of the pool; the training memory asleep then lends it its bytes
(see scheduler.py and colo.Pool).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..checks import check_int
from ..mixed_precision import ROUNDINGS
from .schedules import SCHEDULES
from .settings import (Integer, OneOf, Real, check_settings, json_object, non_negative_int, positive_float, positive_int,
                       save_dtype_name, setting, thread_pair)
from .trackers import check_report_to


DTYPES = ("bf16", "fp32")
# TRL's loss types (colo.grpo.loss: the per-token objective and how token losses are averaged).
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo", "vespo")
SCALES = ("group", "batch", "none")           # what advantages are divided by (colo.grpo.loss)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")   # verl's names (colo.grpo.advantages)
OVERLAP_MODES = ("auto", "on", "off")         # training during generation (colo.grpo.overlap)
# Importance sampling against the engine's log-probabilities (colo.grpo.loss; TRL's modes).
IMPORTANCE_SAMPLING = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# What --save-dtype takes (colo.grpo.export turns the name into a torch dtype).
SAVE_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


TOOL_ISOLATION = ("process", "thread")

@dataclass
class GRPOConfig:
    # -- generation ----------------------------------------------------------------------------------
    prompts_per_step: int = setting(8, "prompts per step over all ranks; each rank generates its share (as even as "
                                    "possible)", group="generation", type=positive_int, metavar="P")
    num_generations: int = setting(8, "completions per prompt, the GRPO group (at least 2: each completion's advantage "
                                   "is its reward against the others')", group="generation",
                                   type=Integer(2, why="completions per prompt: GRPO compares each with the others"),
                                   metavar="G", trl="num_generations")
    max_new_tokens: int = setting(
        16, "longest completion (with tools: every turn's tokens together, the tools' results included)",
        group="generation", type=positive_int, metavar="T", aliases=("--max-completion-length",),
        presets={"dataset": 256}, trl="max_completion_length",
        not_trls_default="TRL's is 512; colo halves a first CPU run's generation")
    temperature: float = setting(1.0, "sampling temperature", group="generation", type=positive_float,
                                 trl="temperature")
    top_p: float = setting(1.0, "nucleus sampling (1.0: off)", group="generation", type=Real(above=0, at_most=1),
                           trl="top_p")
    top_k: int = setting(0, "sample from the k likeliest tokens (0: all)", group="generation",
                         type=non_negative_int, trl="top_k")
    min_p: float | None = setting(None, "min-p sampling (off)", group="generation",
                                  type=Real(at_least=0, at_most=1, optional=True), trl="min_p")
    repetition_penalty: float = setting(1.0, "vLLM's repetition penalty (1.0: off)", group="generation",
                                        type=positive_float, trl="repetition_penalty")
    generation_kwargs: dict | None = setting(
        None, "more of vLLM's SamplingParams fields for every generation, e.g. '{\"presence_penalty\": 0.5}' "
        "(colo's own fields win)", group="generation", type=json_object, metavar="JSON", trl="generation_kwargs",
        check=lambda name, value: value is None or check_generation_kwargs(value))
    ignore_eos: bool = setting(False, "completions run to max_new_tokens", group="generation", cli=False,
                               presets={"toy": True})
    log_completions: bool = setting(
        False, "each step's sampled completions with their rewards and advantages to OUT/completions.jsonl and "
        "the trackers (a TensorBoard text, a wandb Table)", group="generation", action="store_true",
        trl="log_completions")
    num_completions_to_print: int | None = setting(
        None, "with --log-completions: the first N of each step (default: all of the main rank's)",
        group="generation", type=Integer(1, optional=True), metavar="N", trl="num_completions_to_print")
    dynamic_sampling: int = setting(
        0, "DAPO's dynamic sampling: a group whose rewards are all equal is dropped and new prompts' groups are "
        "generated until the step has as many informative groups as prompts, up to N extra generations (the "
        "step then trains on the informative groups it has); the record adds dynamic_sampling/generated_groups, "
        "dropped_groups, trained_groups, extra_generations (colo.grpo.dynamic_sampling); overlapped steps train "
        "the informative groups as they finish and while the replacements generate; not with tensor parallelism",
        group="generation", type=non_negative_int, metavar="N")
    # -- the task (a user's dataset) -------------------------------------------------------------------
    # Prompts longer than max_prompt_length tokens: refused, naming the row, or with truncate_prompts="left"
    # cut to their last max_prompt_length tokens. None: only prompt + completion must fit the model.
    max_prompt_length: int | None = setting(
        None, "refuse longer prompts, naming the row (or cut them with --truncate-prompts left)", group="task",
        type=Integer(1, optional=True), metavar="N")
    truncate_prompts: str | None = setting(None, "keep the last --max-prompt-length tokens of a longer prompt",
                                           group="task", choices=("left",))
    chat_template_kwargs: dict = setting(
        help="extra arguments of the chat template, e.g. '{\"enable_thinking\": false}'", group="task",
        default_factory=dict, type=json_object, metavar="JSON", trl="chat_template_kwargs", default_text="-",
        check=lambda name, value: check_kind(name, value, dict, "a dict"))
    eval_every: int = setting(0, "greedy pass@1 on --eval-dataset every N steps (0: never)", group="task",
                              type=non_negative_int, metavar="N", trl="eval_steps", aliases=("--eval-steps",),
                              not_trls_default="colo evaluates only when asked")
    eval_on_start: bool = setting(False, "evaluate once before the first step, the base model's pass@1 (logged as "
                                  "step 0)", group="task", action="store_true", trl="eval_on_start")
    # -- the loss and its variants ------------------------------------------------------------------
    loss_type: str = setting(
        "dapo", "grpo (sequence means), dapo (token mean over the batch), dr_grpo (token sum / (sequences x max new "
        "tokens)), bnpo (token mean; TRL's is per micro-batch, colo's over the whole batch), luspo (sequence sums, "
        "their mean), cispo (the ratio capped at --epsilon-high and detached, times the log-probability), sapo (a "
        "soft gate instead of the clip), vespo (each sequence's gradient weighed by a gamma function of its ratio); "
        "colo.grpo.loss", group="loss", choices=LOSS_TYPES, trl="loss_type")
    importance_sampling_level: str = setting(
        "token", "ratios per token, or per sequence (GSPO: one ratio per sequence, exp of its mean token log-ratio)",
        group="loss", choices=("token", "sequence"), trl="importance_sampling_level")
    num_iterations: int = setting(
        1, "optimizer steps per rollout (mu); the later ones clip against the log-probabilities the rollout was "
        "sampled at (a forward without gradients first, as TRL)", group="loss", type=positive_int, metavar="MU",
        trl="num_iterations")
    steps_per_generation: int = setting(
        1, "one rollout trained as this many slices of its groups, an optimizer step each (every rank's share "
        "needs at least that many groups)", group="loss", type=positive_int, metavar="S",
        trl="steps_per_generation", default_text="1", not_trls_default="TRL's None means gradient_accumulation_steps")
    multi_objective_aggregation: str = setting(
        "sum_then_normalize", "several rewards: the weighted sum, then the group's normalization; or "
        "normalize_then_sum (GDPO: each function normalized in its group, the weighted sum normalized over the "
        "whole batch, every rank's; --scale-rewards then does not apply)", group="loss",
        choices=("sum_then_normalize", "normalize_then_sum"), trl="multi_objective_aggregation")
    top_entropy_quantile: float = setting(
        1.0, "the policy term counts only the tokens whose entropy is in the top RHO of a micro-batch's (the KL "
        "term keeps them all; TRL takes the quantile over its micro-batch gathered across processes, colo over "
        "each micro-batch a rank computes at once: rows of similar length, at most --micro-batch-size of them, "
        "or one prompt's group in an overlapped step)", group="loss", type=Real(above=0, at_most=1), metavar="RHO",
        trl="top_entropy_quantile")
    epsilon_low: float = setting(0.2, "clip range below ratio 1 (and above, unless --epsilon-high)", group="loss",
                                 type=Real(at_least=0, below=1), flag="--epsilon", trl="epsilon")
    epsilon_high: float | None = setting(None, "clip range above ratio 1 (DAPO's clip-higher; None: epsilon's)",
                                         group="loss", type=Real(at_least=0), trl="epsilon_high",
                                         default_text="`--epsilon`")
    delta: float | None = setting(None, "two-sided clipping: the unclipped ratio capped at DELTA (> 1 + epsilon_high)",
                                  group="loss", type=float, trl="delta")
    beta: float = setting(0.0, "KL-to-reference weight (0: none). With LoRA the reference is the shared base, free; "
                          "with full fine-tuning a frozen second copy of the weights (colo.plan shows its bytes)",
                          group="loss", type=Real(at_least=0), trl="beta")
    sync_ref_model: bool = setting(
        False, "move the KL reference towards the policy every --ref-model-sync-steps optimizer steps, ref = "
        "(1 - alpha) ref + alpha policy (TR-DPO's; TRL's): needs --beta > 0 and full fine-tuning", group="loss",
        action="store_true", trl="sync_ref_model")
    ref_model_mixup_alpha: float = setting(0.6, "sync_ref_model's alpha", group="loss",
                                           type=Real(at_least=0, at_most=1), trl="ref_model_mixup_alpha")
    ref_model_sync_steps: int = setting(512, "sync_ref_model's period, in optimizer steps", group="loss",
                                        type=positive_int, metavar="N", trl="ref_model_sync_steps")
    off_policy_mask_threshold: float | None = setting(
        None, "off-policy sequence masking (OPSM, DeepSeek-V3.2's; TRL's): a completion with a negative advantage whose "
        "mean per-token KL from the engine's sampling log-probabilities to the trainer's exceeds this is left out of "
        "the policy term (TRL suggests 0.5); None: off", group="loss", type=Real(above=0, optional=True, why="a KL"),
        trl="off_policy_mask_threshold")
    router_aux_loss_coef: float | None = setting(
        None, "MoE models: the weight of the load-balancing loss the model's own forward computes from its router "
        "logits, added to the loss (TRL's; 0: off; None: the model config's router_aux_loss_coef, 0 where it has "
        "none); computed per micro-batch over its tokens, the record's aux_loss", group="loss",
        type=Real(at_least=0, optional=True),
        trl="router_aux_loss_coef", default_text="the model's")
    use_bias_correction_kl: bool = setting(True, "the KL term without the ratio", group="loss",
                                           action="store_false", flag="--no-bias-correction-kl",
                                           trl="use_bias_correction_kl", default_text="the correction on")
    advantage_estimator: str = setting(
        "grpo", "how a completion's reward becomes its advantage (verl's adv_estimator names): grpo (the group's "
        "mean taken off, --scale-rewards), rloo (the mean of its scorable siblings taken off, TRL's RLOOTrainer; "
        "--normalize-advantages) or reinforce_plus_plus (REINFORCE++: the rewards whitened over every model token "
        "of the batch, verl's; the KL stays in the loss, --beta)", group="loss", choices=ADVANTAGE_ESTIMATORS)
    normalize_advantages: bool = setting(
        False, "rloo: the advantages normalized over the whole batch, every rank's (TRL's RLOOConfig "
        "normalize_advantages)", group="loss", action="store_true")
    # Advantages divided by the std of the group ("group", or True), of the whole batch ("batch"), or
    # not at all ("none", or False: Dr. GRPO).
    scale_rewards: str = setting("group", "divide advantages by the group's std, the batch's, or not at all "
                                 "(none: Dr. GRPO)", group="loss", choices=SCALES, trl="scale_rewards")
    mask_truncated: bool = setting(False, "leave completions cut by --max-new-tokens out of the loss (DAPO's overlong "
                                   "filtering; counted in the record's clipped_ratio)", group="loss",
                                   action="store_true", aliases=("--mask-truncated-completions",),
                                   trl="mask_truncated_completions")
    sapo_temperature_pos: float = setting(1.0, "SAPO's temperature for positive advantages", group="loss",
                                          type=positive_float, trl="sapo_temperature_pos")
    sapo_temperature_neg: float = setting(1.05, "SAPO's temperature for the others", group="loss",
                                          type=positive_float, trl="sapo_temperature_neg")
    # VESPO's k is a power and its lambda a decay.
    vespo_k_pos: float = setting(2.0, "VESPO's gamma weights: k for positive advantages", group="loss",
                                 type=Real(at_least=0), trl="vespo_k_pos")
    vespo_lambda_pos: float = setting(3.0, "VESPO's lambda for positive advantages", group="loss",
                                      type=Real(at_least=0), trl="vespo_lambda_pos")
    vespo_k_neg: float = setting(3.0, "VESPO's k for the others", group="loss", type=Real(at_least=0),
                                 trl="vespo_k_neg")
    vespo_lambda_neg: float = setting(2.0, "VESPO's lambda for the others", group="loss", type=Real(at_least=0),
                                      trl="vespo_lambda_neg")
    # Importance sampling against the engine's log-probabilities: a mode of IMPORTANCE_SAMPLING, and the
    # ratio's cap and floor (None: none).
    importance_sampling: str = setting(
        "off", "correct for the engine's log-probabilities: off, token_truncate, token_mask, sequence_truncate or "
        "sequence_mask", group="loss", choices=IMPORTANCE_SAMPLING, trl="vllm_importance_sampling_mode",
        aliases=("--vllm-importance-sampling-mode",),
        not_trls_default="TRL's correction is on (sequence_mask): it corrects for an engine serving other numbers "
        "than the trainer computes (a bf16 copy under an fp32 trainer); colo's engine serves the trainer's own "
        "weights, the gap is rounding (engine_logprob_max_abs_diff in every record)")
    importance_sampling_max: float | None = setting(3.0, "the importance-sampling ratio's cap", group="loss",
                                                    type=Real(above=0, optional=True), metavar="C", trl="vllm_importance_sampling_clip_max",
                                                    aliases=("--vllm-importance-sampling-clip-max",))
    importance_sampling_min: float | None = setting(None, "the importance-sampling ratio's floor", group="loss",
                                                    type=Real(at_least=0, optional=True), metavar="C", trl="vllm_importance_sampling_clip_min",
                                                    aliases=("--vllm-importance-sampling-clip-min",))
    # -- optimizer ------------------------------------------------------------------------------------
    learning_rate: float = setting(
        1e-3, "AdamW's learning rate", group="optimizer", type=positive_float, flag="--lr", aliases=("--learning-rate",),
        presets={"toy": 3e-3, "dataset": 1e-6}, trl="learning_rate",
        default_text="1e-3 (the library's); 3e-3 (toy); 1e-6 with `--dataset`")
    lr_scheduler_type: str = setting(
        "constant", "the learning rate after warm-up: constant, or linear / cosine to 0 at the run's last optimizer "
        "step (--steps x --steps-per-generation x --num-iterations; transformers' schedules)", group="optimizer",
        choices=SCHEDULES, trl="lr_scheduler_type",
        not_trls_default="TRL's is linear; colo keeps the rate a run started with unless asked")
    warmup_steps: int = setting(0, "linear warm-up steps, from lr/N at the first step (transformers' starts at 0)",
                                group="optimizer", type=non_negative_int, metavar="N", trl="warmup_steps")
    warmup_ratio: float = setting(0.0, "warm-up as a fraction of the run's optimizer steps (--warmup-steps wins)",
                                  group="optimizer", type=Real(at_least=0, below=1), metavar="R")
    weight_decay: float = setting(0.0, "AdamW's weight decay", group="optimizer", type=Real(at_least=0),
                                  trl="weight_decay")
    adam_betas: tuple[float, float] = setting(
        (0.9, 0.99), "AdamW's betas", group="optimizer", type=float, nargs=2, metavar=("B1", "B2"), from_flag=tuple,
        check=lambda name, value: [Real(at_least=0, below=1).check(name, beta) for beta in value],
        trl="adam_beta1, adam_beta2", not_trls_default="TRL's beta2 is 0.999; colo's toy runs were tuned at 0.99")
    adam_epsilon: float = setting(1e-8, "AdamW's epsilon", group="optimizer", type=positive_float, trl="adam_epsilon")
    max_grad_norm: float | None = setting(1.0, "clip the gradient norm to this (0: no clipping)", group="optimizer",
                                          type=Real(above=0, optional=True), from_flag=lambda value: value or None,
                                          trl="max_grad_norm")
    # A step whose gradient norm is not finite skips its optimizer step (the weights stay as they were);
    # this many such steps in a row stop the run (colo.errors.NonFiniteGradients).
    max_skipped_steps: int = setting(
        3, "a step whose gradient norm is inf or NaN skips its update (counted in the step record); N such steps "
        "in a row stop the run, the last checkpoint intact", group="optimizer", type=positive_int, metavar="N")
    max_steps: int | None = setting(
        None, "the schedule's length in optimizer steps (the command line sets it from --steps x "
        "--steps-per-generation x --num-iterations)", group="optimizer", cli=False, check=Integer(1, optional=True))
    # -- memory, precision, parallelism -----------------------------------------------------------------
    # None: on a GPU, where activations bound the completion length, off on a CPU (checkpointing_on).
    gradient_checkpointing: bool | None = setting(
        None, "recompute each decoder layer's activations in backward (transformers' non-reentrant checkpointing): "
        "the same gradient, less activation memory for more compute (bench/results/"
        "cpu-gradient-checkpointing-avx2.json)", group="memory", choices=("on", "off"),
        from_flag=lambda value: value == "on", check=OneOf((None, True, False)), trl="gradient_checkpointing",
        default_text="on a GPU, off on a CPU",
        not_trls_default="TRL's is on; at colo.grpo's CPU sizes memory is not what binds")
    micro_batch_size: int | None = setting(
        None, "sequences per forward and backward (their gradients add up to the step's): bounds the activations' "
        "memory", group="memory", type=Integer(1, optional=True), metavar="N",
        default_text="rows of similar length together (one prompt's rows together, the prompt computed once), "
        "4096 positions at most")
    memory_phases: bool = setting(
        True, "the KV cache asleep while training, the gradients asleep while generating: a switch for "
        "comparisons (the bench's), always on in a run", group="memory", cli=False)
    # Train each prompt's group while the engine decodes the others' (colo.grpo.overlap). Exactly
    # on-policy either way.
    overlap: str = setting("auto", "train each prompt's group while the engine still decodes the others, exactly "
                           "on-policy (auto: where it measured faster on this device kind; the step record says "
                           "why a step ran serially)", group="memory", choices=OVERLAP_MODES)
    overlap_threads: tuple[int, int] | None = setting(
        None, "CPU: the engine's and the trainer's threads while both have work in an overlapped step (the groups "
        "left when generation ends train with every thread)", group="memory", type=thread_pair, metavar="E,T",
        check=lambda name, value: value is None or check_thread_pair(name, value), default_text="half the cores each")
    # Optimizer state to host memory while generating. None: only where the pool cannot hold it beside
    # the engine's weights and KV cache (TrainingMemory.must_offload); otherwise the copies would cost
    # time for nothing (on a host pool the "host copy" is even the same RAM).
    offload_optimizer: bool | None = setting(
        None, "optimizer state to host memory while generating (auto: only where the pool cannot hold it beside "
        "the engine's weights and KV cache)", group="memory", choices=("auto", "on", "off"),
        from_flag={"auto": None, "on": True, "off": False}.get, check=OneOf((True, False, None), "where the pool needs it"),
        default_text="`auto`")
    # None: the dtype that makes a whole step fastest on this device (resolve_dtype), decided at start.
    dtype: str | None = setting(
        None, "weights the engine serves and the trainer shares: bf16 (fp32 master weights and AdamW moments with "
        "the optimizer, fp32 gradient accumulation) or fp32; auto: the one that makes a whole step fastest here "
        "(bf16 on GPUs since Ampere, CPUs with AMX, and CPUs with AVX512_BF16 where a bf16 matmul times faster "
        "than fp32; fp32 elsewhere)", group="memory", choices=("auto", *DTYPES),
        from_flag=lambda value: None if value == "auto" else value, check=OneOf((*DTYPES, None), "the fastest here"),
        default_text="`auto`")
    master_rounding: str = setting(
        "stochastic", "how bf16 weights take the fp32 masters' values after each optimizer step: stochastic (rounded "
        "up with the probability of the master's distance from the bf16 value below: the served weights are the "
        "masters in expectation, so updates smaller than a bf16 step reach them) or nearest", group="memory",
        choices=ROUNDINGS)
    share_check: bool = setting(
        True, "before the first step, compare the engine's and the trainer's log-probabilities of a probe text and "
        "refuse a model they compute differently beyond the dtype's rounding (colo.share_check), and again after a "
        "publish of changed weights", group="memory", action="store_false", flag="--no-share-check")
    shard_optimizer: bool = setting(
        False, "ZeRO-1: each rank keeps 1/world of the fp32 master weights and AdamW moments; gradients are "
        "reduce-scattered to their shard and the updated weights all-gathered straight into every rank's engine "
        "weights", group="memory", action="store_true")
    # Tensor parallelism (colo.tensor_parallel): ranks per engine; each holds only its shards, views of
    # its engine's. The torchrun world is world / tensor_parallel data-parallel groups of it.
    tensor_parallel: int = setting(1, "ranks per engine (under torchrun; each holds only its shards of the weights, "
                                   "views of its engine's)", group="memory", type=positive_int, metavar="N",
                                   default_text="1, or the resumed run's")
    lora_rank: int = setting(
        0, "train a LoRA adapter of rank R on the frozen base instead of every weight (0: full fine-tuning); the "
        "adapter is the engine's LoRA slot, so nothing is copied per step, and OUT/adapter holds it in PEFT's "
        "format", group="memory", type=non_negative_int, metavar="R")
    lora_alpha: float = setting(8.0, "LoRA alpha (scaling A/R, as PEFT)", group="memory", type=float, metavar="A")
    lora_targets: tuple[str, ...] | None = setting(
        None, "the linear layers the adapter adapts", group="memory", nargs="+", metavar="NAME", from_flag=tuple,
        default_text="every linear of the blocks")
    # MoE models only (colo.moe_routing). Off, the step record still says how often the two routings differ.
    routing_replay: bool = setting(
        False, "MoE models: the trainer routes each token to the experts the engine routed it to (its gate weights "
        "from its own router); without it the step record still says how often the two routings differ "
        "(router_mismatch)", group="memory", action="store_true")
    disable_dropout: bool = setting(
        False, "train with the model's dropout off (every dropout layer's and attention's probability 0), so the "
        "trainer computes what the engine serves; models whose config has dropout (GPT-2's 0.1)", group="memory",
        action="store_true", trl="disable_dropout")
    train_vision: bool = setting(False, "vision-language models: train the vision tower too (frozen by default; the "
                                 "projector and the language model train)", group="memory", action="store_true")
    seed: int = setting(0, "seeds the toy model, prompts and sampling", group="generation", type=non_negative_int,
                        trl="seed", not_trls_default="TRL's is 42")
    # -- checkpoints, the trained model, trackers --------------------------------------------------------
    save_every: int = setting(10, "checkpoint period in steps (0: only at the end)", group="saving",
                              type=non_negative_int, metavar="N")
    keep_checkpoints: int = setting(2, "newest checkpoints kept (0: all)", group="saving", type=non_negative_int,
                                    metavar="K")
    # The model in Hugging Face format (colo.grpo.export): OUT/final at the end of every run.
    save_model_every: int = setting(0, "also write OUT/model-step-N every N steps (0: only OUT/final)",
                                    group="saving", type=non_negative_int, metavar="N")
    save_dtype: str | None = setting(
        None, "bf16, fp16 or fp32 for the saved model; full fine-tuning saves the fp32 master weights rounded to it",
        group="saving", type=save_dtype_name, metavar="DTYPE", default_text="the base model's own",
        check=lambda name, value: value is None or check_save_dtype(value))
    merge_lora: bool = setting(False, "with --lora-rank: OUT/final/merged, the base with the adapter merged in, "
                               "beside the PEFT adapter", group="saving", action="store_true")
    report_to: tuple[str, ...] = setting(
        (), "send every step record and the run's config to tensorboard (OUT/runs/RUN_NAME), wandb, trackio, all "
        "(every one installed) or none; repeatable", group="saving", action="extend", nargs="+",
        metavar="TRACKER", trl="report_to", default_text="`none`")
    run_name: str | None = setting(None, "the run's name in the trackers", group="saving", metavar="NAME",
                                   trl="run_name", default_text="OUT's name")
    # -- agentic rollouts (colo.grpo.agent) -------------------------------------------------------------
    max_turns: int = setting(5, "most rounds of tool calls in a rollout", group="agent", type=non_negative_int,
                             metavar="N", aliases=("--max-tool-calling-iterations",),
                             trl="max_tool_calling_iterations", not_trls_default="TRL's None: no limit")
    tool_timeout: float | None = setting(30.0, "seconds a tool call may take before its result is an error",
                                         group="agent", type=Real(above=0, optional=True), metavar="S")
    # Environments and async tools run in the training process either way.
    tool_isolation: str = setting(
        "process", "where sync tools run: worker processes (a tool that crashes, hangs or exhausts its memory ends "
        "its worker, not the run) or threads of the training process (as TRL runs them)", group="agent",
        choices=TOOL_ISOLATION)
    chat_template: str | None = setting(
        None, "the chat template instead of the model's own: a .jinja file, or one TRL ships by name (qwen2_5: "
        "describes tools, ChatML like SmolLM2's)", group="agent", metavar="NAME|FILE.jinja",
        default_text="the model's own")
    structured_outputs_regex: str | None = setting(
        None, "guided decoding: every turn matches REGEX", group="agent", metavar="REGEX",
        aliases=("--vllm-structured-outputs-regex",), trl="vllm_structured_outputs_regex",
        check=lambda name, value: value is None or check_regex(value))

    def __post_init__(self):
        """Each setting's own range or choices are its setting()'s (colo.grpo.settings.check_settings); what is
        here ties settings together. Values TRL's spellings allow are normalized first."""
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon_low  # TRL's: the clip range above 1 is the one below unless set
        self.adam_betas = tuple(self.adam_betas)
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.lora_targets is not None:
            self.lora_targets = (self.lora_targets,) if isinstance(self.lora_targets, str) else tuple(self.lora_targets)
        check_settings(self)
        if self.overlap_threads is not None:
            self.overlap_threads = tuple(self.overlap_threads)
        self.report_to = check_report_to([self.report_to] if isinstance(self.report_to, str) else self.report_to)
        for broken, error, message in self._ties():
            if broken:
                raise error(message)
        if self.lora_rank:
            self.lora_spec  # noqa: B018 - validates rank, alpha and targets

    def _ties(self):
        """(whether the rule is broken, the exception, its message) of each rule that ties settings together."""
        sliced, iterations, on = self.steps_per_generation, self.num_iterations, self.overlap == "on"
        tp, low, high = self.tensor_parallel, self.importance_sampling_min, self.importance_sampling_max
        yield ((self.lr_scheduler_type != "constant" or self.warmup_ratio) and self.max_steps is None, ValueError,
               f"lr_scheduler_type={self.lr_scheduler_type!r} / warmup_ratio={self.warmup_ratio} need max_steps (the "
               "run's optimizer steps)")
        yield (sliced > self.prompts_per_step, ValueError, f"steps_per_generation={sliced} slices a rollout of "
               f"{self.prompts_per_step} prompts' groups: at most prompts_per_step")
        yield (sliced > 1 and self.dynamic_sampling, NotImplementedError,
               "steps_per_generation with dynamic_sampling (a step's groups vary in number)")
        yield (sliced > 1 and on, ValueError, f"steps_per_generation={sliced} with overlap='on': the slices train after "
               "the whole rollout is generated (overlap='auto' or 'off')")
        yield (iterations > 1 and on, ValueError, f"num_iterations={iterations} with overlap='on': a rollout trained on "
               "several times is trained after its generation (overlap='auto' or 'off')")
        yield from self._estimator_ties()
        yield (self.multi_objective_aggregation == "normalize_then_sum" and on, ValueError,
               "multi_objective_aggregation='normalize_then_sum' normalizes over the whole batch: it needs serial "
               "steps (overlap='auto' or 'off')")
        yield (self.delta is not None and not self.delta > 1 + self.epsilon_high, ValueError,
               f"delta (two-sided clipping) must exceed 1 + epsilon_high = {1 + self.epsilon_high}, got {self.delta}")
        yield (self.truncate_prompts and self.max_prompt_length is None, ValueError,
               "truncate_prompts='left' needs max_prompt_length (the tokens to keep)")
        yield (self.sync_ref_model and not self.beta > 0, ValueError,
               "sync_ref_model with beta=0: there is no reference to move (as TRL refuses it)")
        yield (self.sync_ref_model and self.lora_rank, ValueError, "sync_ref_model with lora_rank > 0: an adapter's "
               "reference is the shared base, which has no weights of its own to move (TRL refuses it with PEFT too)")
        yield (self.shard_optimizer and self.lora_rank, ValueError, "shard_optimizer with lora_rank > 0: an adapter's "
               "optimizer state is small; train it unsharded")
        yield (self.merge_lora and not self.lora_rank, ValueError,
               "merge_lora needs lora_rank > 0 (full fine-tuning saves the whole model already)")
        yield (self.dynamic_sampling and tp > 1, ValueError, "dynamic_sampling: each rank generates its own "
               "replacement prompts, so it needs one engine per rank (tensor_parallel=1)")
        yield (self.router_aux_loss_coef and tp > 1, NotImplementedError, "router_aux_loss_coef with tensor_parallel "
               "> 1 (the load-balancing loss of a tensor-parallel model's routers) is not built yet; set it to 0")
        yield (tp > 1 and self.beta > 0, NotImplementedError,
               f"tensor_parallel={tp} with beta > 0 (a reference model) is not built yet")
        yield (tp > 1 and (self.eval_every or self.eval_on_start), NotImplementedError,
               "evaluation (eval_every, eval_on_start) with tensor_parallel > 1 is not built yet")
        yield (self.importance_sampling.endswith("truncate") and low is None and high is None, ValueError,
               f"importance_sampling={self.importance_sampling!r} needs importance_sampling_max or _min")
        yield (low is not None and high is not None and not low < high, ValueError,
               f"importance_sampling_min ({low}) must be below importance_sampling_max ({high})")

    def _estimator_ties(self):
        """Each estimator's own normalization: --scale-rewards and GDPO's aggregation are GRPO's,
        --normalize-advantages RLOO's; REINFORCE++ always whitens over the batch."""
        estimator = self.advantage_estimator
        yield (estimator != "grpo" and self.scale_rewards != "group", ValueError,
               f"scale_rewards={self.scale_rewards!r} is GRPO's normalization; advantage_estimator={estimator!r} has "
               "its own (rloo: normalize_advantages; reinforce_plus_plus: always whitened over the batch)")
        yield (estimator != "grpo" and self.multi_objective_aggregation != "sum_then_normalize", ValueError,
               f"multi_objective_aggregation={self.multi_objective_aggregation!r} (GDPO) normalizes GRPO's way; with "
               f"advantage_estimator={estimator!r} the weighted sum of the rewards is used")
        yield (self.normalize_advantages and estimator != "rloo", ValueError,
               f"normalize_advantages is RLOO's (advantage_estimator='rloo'); with {estimator!r} "
               + ("scale_rewards normalizes" if estimator == "grpo" else "the advantages are whitened over the "
                  "batch already"))

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

    def resolve_dtype(self, device="cpu", world=None) -> "GRPOConfig":
        """This config with `dtype` decided: as given, or the one that makes a whole step fastest on
        `device` (colo.dtype_choice.fastest_dtype: bf16 where the device computes bf16 faster), rank 0's
        on every rank of `world` (on some CPUs the choice rests on a matmul each rank times)."""
        if self.dtype is not None:
            return self
        from ..dtype_choice import fastest_dtype
        from .distributed import gather_objects

        name = fastest_dtype(device).name
        return dataclasses.replace(self, dtype=gather_objects(name, world)[0] if world is not None else name)

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


def check_model_dir(model_dir, tensor_parallel: int = 1, lora_spec=None) -> None:
    """Refuse what colo cannot train before any engine starts (the CLI and the scheduler both ask):
    no Hugging Face model there (FileNotFoundError), an unreadable config.json (ValueError), a model
    that is not a decoder-only causal LM (an encoder) or that vLLM cannot serve (NotImplementedError), a
    config that contradicts itself, a model `tensor_parallel` ranks cannot split, missing or unreadable
    weight files, LoRA targets (`lora_spec`) naming none of its linear layers (ValueError, naming it).
    Whether its weights are shared or copied is decided when the engine is up, from its layout."""
    from pathlib import Path

    from ..shared import check_model_config

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face model at {model_dir} (config.json missing)")
    config = read_model_config(model_dir)
    check_model_config(config)
    from .. import vllm_compat

    unserved = vllm_compat.unserved_architectures(config)
    if unserved is not None:
        raise NotImplementedError(unserved)
    check_weight_files(model_dir)
    if lora_spec is not None:   # the layers it names are there
        from ..lora import check_targets

        check_targets(config, lora_spec)
    if tensor_parallel > 1:
        from ..tensor_parallel import check_shardable

        check_shardable(config, tensor_parallel)



def read_model_config(model_dir):
    """transformers' config of `model_dir`, or a ValueError naming its config.json: whatever transformers
    raises for one it cannot read (bad JSON, an unknown model_type, fields its own validation refuses,
    as attention heads that do not divide the hidden size)."""
    from pathlib import Path

    from transformers import AutoConfig

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - huggingface_hub's StrictDataclassError is no ValueError
        raise ValueError(f"cannot read {path}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}") from e


def check_weight_files(model_dir) -> None:
    """Refuse a model directory without weights (safetensors or PyTorch files, or an index whose shards are
    missing) or with a safetensors file whose header cannot be read, before the engine loads them."""
    import json
    from pathlib import Path

    directory = Path(model_dir)
    for index in (*directory.glob("*.safetensors.index.json"), *directory.glob("*.bin.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"cannot read {index}: {e}") from e
        missing = sorted(s for s in shards if not (directory / s).is_file())
        if missing:
            raise ValueError(f"{index.name} names weight files {directory} lacks: {', '.join(missing[:3])}")
    files = sorted(directory.glob("*.safetensors"))
    if not files and not any(directory.glob("*.bin")) and not any(directory.glob("*.pt")):
        raise ValueError(f"{directory} holds no weights (*.safetensors or *.bin files)")
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise ValueError(f"{file} is not a readable safetensors file ({e})") from e


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
    try:  # the values too, as vLLM checks them when a request is made
        SamplingParams(**kwargs)
    except Exception as e:  # noqa: BLE001 - vLLM raises its own validation errors, and TypeError for a wrong kind
        raise ValueError(f"generation_kwargs {kwargs}: vLLM's SamplingParams refuses them: {e}") from None


def check_kind(name: str, value, kind: type, words: str) -> None:
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be {words}, got {value!r}")


def check_thread_pair(name: str, value) -> None:
    """(engine threads, trainer threads): two positive integers."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be (engine threads, trainer threads), got {value!r}")
    for threads in value:
        check_int(threads, name)


def check_save_dtype(value) -> None:
    if str(value).lower() not in SAVE_DTYPES:
        raise ValueError(f"save_dtype: {value!r} is not a dtype colo saves in; one of bf16, fp16, fp32 or None (the "
                         "base model's own)")


def processed_logprobs(config) -> bool:
    """Whether the run's engine reports the log-probabilities of the distribution it sampled from
    (vLLM's processed ones: after temperature and the sampling filters), which importance sampling and
    off-policy masking compare with the trainer's."""
    return config.importance_sampling != "off" or config.off_policy_mask_threshold is not None


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
