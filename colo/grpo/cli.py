"""`python -m colo.grpo`: a colocated GRPO run from the command line.

    python -m colo.grpo --steps 40 --json log.jsonl --out ckpt/ [--resume] [--model PATH] [--trace trace.json]
    python -m colo.grpo --model DIR --dataset train.jsonl --reward math --reward my_rewards.py:fmt
        --eval-dataset eval.jsonl --eval-every 10 --steps 100 --json log.jsonl --out ckpt/
    python -m colo.grpo --model DIR --dataset sums.jsonl --reward math --tool calc.py:add --max-turns 2
        --chat-template qwen2_5 --steps 30 --json log.jsonl --out ckpt/

With --dataset it trains --model on a user's dataset (JSONL/JSON, Parquet, CSV or a save_to_disk
directory; a `prompt` column of text or chat messages, every other column passed to the reward
functions by name) with --reward functions in TRL's signature (colo.grpo.rewards); with --tool and
--environment the rollouts have several turns, the model calling tools between them (colo.grpo.agent,
TRL's conventions). Without it, the
toy task of colo.grpo.toy_task (reward = share of completion tokens that obey a token rule), on a small
random Qwen2 model written to OUT/toy-model unless --model is given. --config FILE.yaml holds any of
the flags (names with - or _); the command line wins. The run's settings are saved in OUT/run.json;
--resume continues from the newest checkpoint in OUT with those settings.
Exit status: 0 done, 2 bad arguments or unreadable checkpoint, 1 the run failed, 143 stopped by
SIGTERM after a checkpointed step (continue with --resume).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from ..checks import int_kind
from .checkpoint import CheckpointError, checkpoint_to_resume, list_checkpoints
from .config import DTYPES, IMPORTANCE_SAMPLING, LOSS_TYPES, OVERLAP_MODES, SCALES, GRPOConfig, check_model_dir
from .schedules import SCHEDULES

OFFLOAD_CHOICES = {"auto": None, "on": True, "off": False}
TOY_DEFAULTS = dict(prompts_per_step=8, num_generations=8, max_new_tokens=16, ignore_eos=True,
                    learning_rate=3e-3, temperature=1.0)
# A real model on a user's dataset: TRL 1.16's GRPOConfig defaults (lr 1e-6, 8 generations), but 256 new
# tokens (TRL's max_completion_length is 512): half the generation of a first run on a CPU.
DATASET_DEFAULTS = dict(prompts_per_step=8, num_generations=8, max_new_tokens=256, ignore_eos=False,
                        learning_rate=1e-6, temperature=1.0)
# Flags that fill GRPOConfig fields of the same meaning: flag dest -> field.
# A flag sets the config field of its own name (--max-new-tokens: max_new_tokens), except these renames
# and the flags whose values _settings converts itself (their values are not the field's type).
FLAG_RENAMES = {"lr": "learning_rate", "epsilon": "epsilon_low"}
# GRPOConfig fields no flag sets, and why (tests/grpo/test_grpo_loss_variants.py checks every other has one).
LIBRARY_ONLY = {"ignore_eos": "the toy preset's (its completions run to max_new_tokens)",
                "max_steps": "set from --steps (x --steps-per-generation x --num-iterations)",
                "memory_phases": "a switch for comparisons (the bench's), always on in a run"}
CONVERTED_FLAGS = ("adam_betas", "dtype", "gradient_checkpointing", "lora_targets", "offload_optimizer",
                   "tensor_parallel", "max_grad_norm")


def config_values(args) -> dict:
    """{config field: value} of every flag given on the command line (or in --config FILE.yaml) that
    names a GRPOConfig field, CONVERTED_FLAGS aside."""
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    values = {}
    for dest, value in vars(args).items():
        field = FLAG_RENAMES.get(dest, dest)
        if value is not None and field in fields and dest not in CONVERTED_FLAGS:
            values[field] = value
    return values


def _int_at_least(minimum: int):
    """An argparse type: an integer no smaller than `minimum`."""
    kind = int_kind(minimum)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _thread_pair(text: str) -> tuple[int, int]:
    """An argparse type: "E,T", two positive integers."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected ENGINE,TRAINER (two positive integers), got {text!r}")
    return tuple(_positive_int(part.strip()) for part in parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m colo.grpo", description=__doc__.split("\n", 1)[1].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=_positive_int, required=True, help="total steps of the run (a resumed run counts those done)")
    p.add_argument("--json", dest="log", required=True, metavar="LOG", help="JSON-lines file, one record per step")
    p.add_argument("--out", required=True, metavar="CKPT_DIR", help="directory for checkpoints and run.json")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--model", metavar="PATH|ORG/NAME", help="a Hugging Face causal LM directory, or a hub id "
                   "ORG/NAME[@REVISION] (fetched once into the Hugging Face cache; HF_HUB_OFFLINE=1 uses only the "
                   "cache); default: a small random Qwen2")
    p.add_argument("--trace", metavar="FILE", help="Chrome-trace/Perfetto timeline of the phases")
    p.add_argument("--save-every", type=_non_negative_int, default=10, metavar="N", help="checkpoint period (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=_non_negative_int, default=2, metavar="K", help="newest checkpoints kept (0: all)")
    saving = p.add_argument_group("the trained model (Hugging Face format: OUT/final at the end of the run)")
    saving.add_argument("--save-model-every", type=_non_negative_int, metavar="N",
                        help="also write OUT/model-step-N every N steps (default 0: only OUT/final)")
    saving.add_argument("--save-dtype", type=_save_dtype, metavar="DTYPE",
                        help="bf16, fp16 or fp32 (default: the base model's own, its config.json's dtype); full "
                             "fine-tuning saves the fp32 master weights rounded to it")
    saving.add_argument("--merge-lora", action="store_true", default=None,
                        help="with --lora-rank: OUT/final/merged, the base with the adapter merged in, beside the "
                             "PEFT adapter")
    p.add_argument("--config", metavar="FILE.yaml", help="a YAML mapping of any of these flags (the command line wins)")
    p.add_argument("--report-to", action="extend", nargs="+", metavar="TRACKER",
                   help="send every step record and the run's config to tensorboard (OUT/runs/RUN_NAME), wandb, "
                        "trackio, all (every one installed) or none (default); repeatable, TRL's names")
    p.add_argument("--run-name", metavar="NAME", help="the run's name in the trackers (default: OUT's name)")
    task = p.add_argument_group("the task (default: the toy task)")
    task.add_argument("--dataset", metavar="PATH|ORG/NAME", help="training prompts: .jsonl/.json/.parquet/.csv, a "
                      "save_to_disk directory, or a hub dataset ORG/NAME[@REVISION][:CONFIG][:SPLIT] (split default "
                      "train), with a `prompt` column (text or {role, content} messages); needs --model and --reward")
    task.add_argument("--reward", action="append", metavar="SPEC", help="a reward function: FILE.py:NAME, "
                      "module:NAME, math, gsm8k or regex:PATTERN (repeatable; TRL's signature, see colo.grpo.rewards)")
    task.add_argument("--reward-weights", type=float, nargs="+", metavar="W", help="one weight per --reward (default 1 each)")
    task.add_argument("--eval-dataset", metavar="PATH|ORG/NAME", help="prompts for greedy pass@1 per reward function "
                      "(as --dataset)")
    task.add_argument("--eval-every", type=_non_negative_int, metavar="N", help="evaluate every N steps (default 0: never)")
    task.add_argument("--eval-on-start", action="store_true", default=None,
                      help="evaluate once before the first step, the base model's pass@1 (logged as step 0)")
    task.add_argument("--chat-template-kwargs", type=_json_object, metavar="JSON",
                      help='extra arguments of the chat template, e.g. \'{"enable_thinking": false}\'')
    task.add_argument("--max-prompt-length", type=_positive_int, metavar="N",
                      help="refuse longer prompts, naming the row (or cut them with --truncate-prompts left)")
    task.add_argument("--truncate-prompts", choices=("left",), help="keep the last --max-prompt-length tokens")
    agent = p.add_argument_group("agentic rollouts: tools, environments and several turns (TRL's conventions; with --dataset)")
    agent.add_argument("--tool", action="append", metavar="FILE.py:NAME", help="a function the model may call "
                       "(FILE.py:NAME or module:NAME; sync or async, with type hints and a Google-style docstring, "
                       "described to the model by the chat template); repeatable")
    agent.add_argument("--environment", metavar="FILE.py:CLASS", help="TRL's environment_factory: one instance per "
                       "rollout, reset(**row) before it (a string it returns is appended to the prompt), its public "
                       "methods tools, get_reward() a reward of weight 1 (then --reward is optional)")
    agent.add_argument("--max-turns", type=_non_negative_int, metavar="N",
                       help="most rounds of tool calls in a rollout (TRL's max_tool_calling_iterations; default 5)")
    agent.add_argument("--tool-timeout", type=_positive_float, metavar="S",
                       help="seconds a tool call may take before its result is an error (default 30)")
    agent.add_argument("--tool-isolation", choices=("process", "thread"), default=None,
                       help="where sync tools run: worker processes (default; a tool that crashes or hangs ends its "
                            "worker, not the run) or threads of the training process")
    agent.add_argument("--chat-template", metavar="NAME|FILE.jinja",
                       help="the chat template instead of the model's own: a .jinja file, or one TRL ships by name "
                            "(qwen2_5: describes tools, ChatML like SmolLM2's)")
    agent.add_argument("--structured-outputs-regex", metavar="REGEX",
                       help="guided decoding: every turn matches REGEX (TRL's vllm_structured_outputs_regex)")
    agent.add_argument("--importance-sampling", choices=IMPORTANCE_SAMPLING,
                       help="correct for the engine's log-probabilities (TRL's vllm_importance_sampling_mode; "
                            "default off)")
    agent.add_argument("--importance-sampling-max", type=float, metavar="C",
                       help="the ratio's cap (default 3.0, TRL's)")
    agent.add_argument("--importance-sampling-min", type=float, metavar="C", help="the ratio's floor (default none)")
    gen = p.add_argument_group("generation and loss (defaults: the toy's, or TRL's with --dataset)")
    gen.add_argument("--prompts-per-step", type=_positive_int, metavar="P", help="prompts per step over all ranks (8)")
    gen.add_argument("--num-generations", type=_positive_int, metavar="G", help="completions per prompt, the GRPO group (8)")
    gen.add_argument("--max-new-tokens", type=_positive_int, metavar="T", help="longest completion (16; 256 with --dataset; TRL's max_completion_length, whose default is 512)")
    gen.add_argument("--temperature", type=_positive_float, help="sampling temperature (1.0)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling (1.0: off)")
    gen.add_argument("--top-k", type=_non_negative_int, help="sample from the k likeliest tokens (0: off)")
    gen.add_argument("--log-completions", action="store_true", default=None,
                     help="each step's sampled completions with their rewards and advantages to OUT/completions.jsonl "
                          "and the trackers (TRL's log_completions)")
    gen.add_argument("--num-completions-to-print", type=_positive_int, metavar="N",
                     help="with --log-completions: the first N of each step (default: all)")
    gen.add_argument("--min-p", type=float, help="min-p sampling (TRL's min_p; default off)")
    gen.add_argument("--repetition-penalty", type=float, help="vLLM's repetition penalty (1.0: off)")
    gen.add_argument("--generation-kwargs", type=_json_object, metavar="JSON",
                     help="more of vLLM's SamplingParams fields, e.g. '{\"presence_penalty\": 0.5}' (TRL's generation_kwargs)")
    gen.add_argument("--mask-truncated", action="store_true", default=None,
                     help="leave completions cut by --max-new-tokens out of the loss (TRL's mask_truncated_completions)")
    gen.add_argument("--loss-type", choices=LOSS_TYPES, help="TRL's: grpo: sequence means; dapo (default): token mean "
                     "over the batch; dr_grpo: token sum / (sequences x max new tokens); bnpo, luspo, cispo, sapo "
                     "(docs/grpo.md)")
    opt = p.add_argument_group("optimizer (TRL's names)")
    opt.add_argument("--lr-scheduler-type", choices=SCHEDULES, help="the learning rate after warm-up: constant "
                     "(default), or linear / cosine to 0 at the last step")
    opt.add_argument("--warmup-steps", type=int, metavar="N", help="linear warm-up steps (0)")
    opt.add_argument("--warmup-ratio", type=float, metavar="R", help="warm-up as a fraction of the run's optimizer "
                     "steps (--warmup-steps wins)")
    opt.add_argument("--weight-decay", type=float, help="AdamW's weight decay (0)")
    opt.add_argument("--adam-betas", type=float, nargs=2, metavar=("B1", "B2"), help="AdamW's betas (0.9 0.99)")
    opt.add_argument("--adam-epsilon", type=float, help="AdamW's epsilon (1e-8)")
    opt.add_argument("--max-grad-norm", type=float, help="clip the gradient norm to this (1.0); 0: no clipping")
    opt.add_argument("--gradient-checkpointing", choices=("on", "off"),
                     help="recompute activations in backward (default: on a GPU, off on a CPU)")
    gen.add_argument("--multi-objective-aggregation", choices=("sum_then_normalize", "normalize_then_sum"),
                     help="several rewards: sum then normalize in the group (default), or normalize each in its "
                          "group, sum, and normalize over the batch (GDPO; TRL's names)")
    gen.add_argument("--top-entropy-quantile", type=float, metavar="RHO",
                     help="the policy term counts only the top RHO of tokens by entropy (TRL's; 1.0: all)")
    gen.add_argument("--dynamic-sampling", type=_non_negative_int, metavar="N",
                     help="DAPO's dynamic sampling: replace groups whose rewards are all equal with new prompts' "
                          "groups, up to N extra generations a step (0: off)")
    gen.add_argument("--steps-per-generation", type=_positive_int, metavar="S",
                     help="optimizer steps per rollout, each on a slice of its groups (TRL's steps_per_generation, 1)")
    gen.add_argument("--num-iterations", type=_positive_int, metavar="MU",
                     help="optimizer steps per rollout (TRL's num_iterations, 1); the later ones clip against the "
                          "log-probabilities the rollout was sampled at")
    gen.add_argument("--importance-sampling-level", choices=("token", "sequence"),
                     help="ratios per token (default) or per sequence (GSPO), TRL's importance_sampling_level")
    gen.add_argument("--delta", type=float, help="two-sided clipping: the unclipped ratio capped at DELTA (> 1 + "
                     "epsilon_high; default off)")
    gen.add_argument("--no-bias-correction-kl", dest="use_bias_correction_kl", action="store_false", default=None,
                     help="the KL term without the ratio (TRL's use_bias_correction_kl=False)")
    gen.add_argument("--sapo-temperature-pos", type=float, help="SAPO's temperature for positive advantages (1.0)")
    gen.add_argument("--sapo-temperature-neg", type=float, help="SAPO's temperature for the others (1.05)")
    for name, default in (("k-pos", 2.0), ("lambda-pos", 3.0), ("k-neg", 3.0), ("lambda-neg", 2.0)):
        gen.add_argument(f"--vespo-{name}", type=float, help=f"VESPO's gamma weights ({default})")
    gen.add_argument("--epsilon", type=float, help="clip range below ratio 1 (and above, unless --epsilon-high) (0.2)")
    gen.add_argument("--epsilon-high", type=float, help="clip range above ratio 1 (DAPO's clip-higher)")
    gen.add_argument("--scale-rewards", choices=SCALES, help="divide advantages by the group's std (default), the "
                     "batch's, or none (Dr. GRPO)")
    gen.add_argument("--beta", type=float, help="KL-to-reference weight (0: none). With LoRA the reference is the shared "
                     "base, free; with full fine-tuning a frozen second copy of the weights (colo.plan shows its bytes)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (3e-3 for the toy; 1e-6, TRL's, with --dataset)")
    p.add_argument("--micro-batch-size", type=_positive_int, metavar="N",
                   help="sequences per forward and backward (their gradients add up to the step's; default: rows of "
                        "similar length together, 4096 positions at most): bounds the activations' memory")
    p.add_argument("--max-skipped-steps", type=_positive_int, metavar="N",
                   help="a step whose gradient norm is inf or NaN skips its update (counted in the step record); "
                        "N such steps in a row stop the run, the last checkpoint intact (default 3)")
    p.add_argument("--offload-optimizer", choices=sorted(OFFLOAD_CHOICES), default="auto",
                   help="optimizer state to host memory while generating (auto: only where the pool cannot hold "
                        "it beside the engine's weights and KV cache)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="weights the engine serves and the trainer shares: bf16 (fp32 master weights and AdamW "
                        "moments with the optimizer) or fp32; auto (default): the one that makes a whole step "
                        "fastest here (bf16 where the device computes in bf16 natively: GPUs since Ampere, CPUs "
                        "with AVX512_BF16 or AMX; fp32 elsewhere)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="ZeRO-1: each rank keeps 1/world of the fp32 master weights and AdamW moments; the "
                        "updated weights are all-gathered straight into every rank's engine weights")
    p.add_argument("--lora-rank", type=_non_negative_int, default=0, metavar="R",
                   help="train a LoRA adapter of rank R on the frozen base instead of every weight (0, the "
                        "default: full fine-tuning); the adapter is the engine's LoRA slot, so nothing is copied "
                        "per step, and OUT/adapter holds it in PEFT's format")
    p.add_argument("--lora-alpha", type=float, default=8.0, metavar="A", help="LoRA alpha (scaling A/R; default %(default)s, as PEFT)")
    p.add_argument("--lora-targets", nargs="+", metavar="NAME",
                   help="linear layers the adapter adapts (default: all of them)")
    p.add_argument("--routing-replay", action="store_true", default=None,
                   help="MoE models: the trainer routes each token to the experts the engine routed it to (its "
                        "gate weights from its own router); without it the step record still says how often "
                        "the two routings differ (router_mismatch)")
    p.add_argument("--train-vision", action="store_true", default=None,
                   help="vision-language models: train the vision tower too (frozen by default; the projector and "
                        "the language model train)")
    p.add_argument("--tensor-parallel", type=_positive_int, default=None, metavar="N",
                   help="ranks per engine (under torchrun; each holds only its shards of the weights, views of its "
                        "engine's; default 1, or the resumed run's)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seeds the toy model, prompts and sampling")
    p.add_argument("--overlap", choices=OVERLAP_MODES, help="train each prompt's group while the engine still decodes "
                   "the others, exactly on-policy (auto, the default: where it measured faster on this device kind; "
                   "the step record says why a step ran serially)")
    p.add_argument("--overlap-threads", type=_thread_pair, metavar="E,T", help="CPU: the engine's and the trainer's "
                   "threads while both have work in an overlapped step (default: half the cores each)")
    p.add_argument("--eager", action="store_true", help="run the engine without compiling it (starts faster, "
                   "generates slower; vLLM's enforce_eager)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _save_dtype(text: str) -> str:
    from ..hf_format import save_dtype

    try:
        save_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--save-dtype: ")) from None
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The flags, with --config FILE.yaml's values as defaults under the command line's."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config")
    args = first.parse_known_args(argv)[0]
    _refuse_unknown_flags(parser, argv)
    if not args.config:
        return parser.parse_args(argv)
    import yaml

    try:
        loaded = yaml.safe_load(Path(args.config).read_text())
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config: cannot read {args.config}: {e}")
    if not isinstance(loaded, dict):
        parser.error(f"--config: {args.config} must hold a mapping of flags to values")
    known = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    defaults = {}
    for key, value in loaded.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest == "json":
            dest = "log"
        if dest not in known:
            parser.error(f"--config: {args.config}: unknown setting {key!r}{_closest(dest, parser, yaml=True)}")
        action = known[dest]
        if action.type is not None and value is not None and not isinstance(value, (list, dict, bool)):
            try:
                value = action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError) as e:
                parser.error(f"--config: {args.config}: {key}: {e}")
        if dest == "reward" and isinstance(value, str):
            value = [value]
        defaults[dest] = value
    for action in parser._actions:  # required flags the file provides are no longer required
        if action.dest in defaults:
            action.required = False
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


def _closest(name: str, parser, yaml: bool = False) -> str:
    """' (did you mean X?)' for the setting closest to `name` (a flag, or a renamed flag's config field:
    learning_rate -> --lr), or ''."""
    import difflib

    dests = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
    shown = {**{dest: (dest if yaml else flag) for dest, flag in dests.items()},
             **{field: (flag if yaml else f"--{flag}") for flag, field in FLAG_RENAMES.items()}}
    key = name.replace("-", "_")
    close = difflib.get_close_matches(key, sorted(shown), n=1, cutoff=0.6)
    return f" (did you mean {shown[close[0]]}?)" if close else ""


def _refuse_unknown_flags(parser, argv) -> None:
    """An unknown --flag is an error naming the closest setting (argparse says only 'unrecognized')."""
    flags = {o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")}
    for word in sys.argv[1:] if argv is None else argv:
        name = word[2:].split("=", 1)[0] if word.startswith("--") else None
        if name and name not in flags and not any(f.startswith(name) for f in flags):  # argparse takes prefixes
            parser.error(f"unrecognized flag --{name}{_closest(name, parser)}")


def _settings(args, parser) -> tuple[Path, GRPOConfig]:
    """Model directory and config: from the flags for a new run, from OUT/run.json when resuming."""
    out = Path(args.out)
    run_file = out / "run.json"
    from ..hf_format import check_writable

    try:  # before anything loads, not after the first steps
        check_writable(out)
        check_writable(Path(args.log).resolve().parent, "--json")
    except ValueError as e:
        parser.error(str(e))
    if args.resume:
        if not run_file.is_file():
            parser.error(f"--resume: {run_file} not found; is {out} the --out of an earlier run?")
        try:
            saved = json.loads(run_file.read_text())
            config = GRPOConfig.from_dict(saved["config"])
            model_dir = Path(saved["model_dir"])
            if args.model or saved.get("model"):
                from ..hub import resolve_model

                model_dir = resolve_model(args.model or saved["model"])
            for key, value in (saved.get("task") or {}).items():
                setattr(args, key if key != "rewards" else "reward", value)
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--resume: cannot read {run_file}: {e}")
        try:  # fail here, with a clear message, before any engine starts (the scheduler asks again)
            checkpoint_to_resume(out, lead="")
        except CheckpointError as e:
            parser.error(f"--resume: {e}")
        if args.tensor_parallel not in (None, config.tensor_parallel):
            parser.error(f"--resume: the run in {out} was trained with --tensor-parallel {config.tensor_parallel}; "
                         f"colo does not re-slice its optimizer state for --tensor-parallel {args.tensor_parallel}: "
                         f"resume with --tensor-parallel {config.tensor_parallel}")
        return model_dir, config
    if list_checkpoints(out):
        parser.error(f"{out} already holds checkpoints of a run; pass --resume to continue it or choose another --out")
    values = dict(DATASET_DEFAULTS if args.dataset else TOY_DEFAULTS)
    values.update(config_values(args))
    if args.epsilon is not None and args.epsilon_high is None:
        values["epsilon_high"] = args.epsilon  # TRL: epsilon_high defaults to epsilon
    if args.adam_betas is not None:
        values["adam_betas"] = tuple(args.adam_betas)
    if args.gradient_checkpointing is not None:
        values["gradient_checkpointing"] = args.gradient_checkpointing == "on"
    if args.max_grad_norm is not None:
        values["max_grad_norm"] = args.max_grad_norm or None   # 0: no clipping
    # The schedule's length: every optimizer step of the run.
    values["max_steps"] = args.steps * (values.get("num_iterations") or 1) * (values.get("steps_per_generation") or 1)
    try:
        config = GRPOConfig(**{**values, "offload_optimizer": OFFLOAD_CHOICES[args.offload_optimizer],
                               "lora_targets": tuple(args.lora_targets) if args.lora_targets else None, "tensor_parallel": args.tensor_parallel or 1,
                               "dtype": None if args.dtype == "auto" else args.dtype})
    except (ValueError, NotImplementedError) as e:
        parser.error(str(e))
    _check_task_flags(args, parser)
    if args.model:
        from ..hub import pinned, resolve_model

        try:  # a hub id is pinned to the commit it resolves to now, so --resume reads the same files
            args.model = pinned(args.model, kind="model")
            model_dir = resolve_model(args.model)
        except ValueError as e:
            parser.error(f"--model {e}")
        if not (model_dir / "config.json").is_file():
            parser.error(f"--model: {model_dir} is not a Hugging Face model directory (no config.json)")
        try:
            check_model_dir(model_dir, config.tensor_parallel)
        except (ValueError, NotImplementedError) as e:
            parser.error(f"--model: {model_dir}: {e}")
    else:
        model_dir = out / "toy-model"
    return model_dir, config


def _check_task_flags(args, parser) -> None:
    """The dataset flags go together; reward functions and data files are loaded here, before any
    engine starts, so a wrong name fails in a second."""
    from ..hub import load_dataset_spec, pinned
    from .rewards import load_reward
    from .task import PROMPT

    if not args.dataset:
        for flag in ("reward", "reward_weights", "eval_dataset", "eval_every", "eval_on_start", "chat_template_kwargs",
                     "max_prompt_length", "tool", "environment", "chat_template"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} needs --dataset (the toy task has its own prompts and reward)")
        return
    if not args.model:
        parser.error("--dataset needs --model (a Hugging Face model directory with its tokenizer)")
    tools, environment = load_agent_flags(args, parser)
    # What was loaded here is what the run uses (user code is imported once).
    args.loaded = {"tools": tools, "environment": environment, "rewards": []}
    rewarding = environment is not None and callable(getattr(environment, "get_reward", None))
    if not args.reward and not rewarding:
        parser.error("--dataset needs at least one --reward (or an --environment with get_reward)")
    if args.reward_weights and len(args.reward_weights) != len(args.reward or ()):
        parser.error(f"--reward-weights: {len(args.reward_weights)} weights for {len(args.reward)} --reward functions")
    for flag in ("eval_every", "eval_on_start"):
        if getattr(args, flag) and not args.eval_dataset:
            parser.error(f"--{flag.replace('_', '-')} needs --eval-dataset")
    for spec in args.reward or ():
        try:
            if spec.startswith("model:"):  # its config only: the weights load once, in the run
                from .reward_model import check_reward_model

                check_reward_model(spec[len("model:"):])
                args.loaded["rewards"].append(spec)
                continue
            args.loaded["rewards"].append(load_reward(spec))
        except (ValueError, ImportError) as e:
            parser.error(f"--reward: {e}")
    for flag in ("dataset", "eval_dataset"):
        path = getattr(args, flag)
        if path:
            try:
                path = pinned(path, kind="dataset")
                setattr(args, flag, path)  # run.json keeps the pinned name
                columns = load_dataset_spec(path).column_names
            except (ValueError, ImportError) as e:
                parser.error(f"--{flag.replace('_', '-')}: {e}")
            if PROMPT not in columns:
                parser.error(f"--{flag.replace('_', '-')}: {path} has no {PROMPT!r} column (it has "
                             f"{', '.join(columns)})")


def load_agent_flags(args, parser):
    """--tool and --environment loaded and checked (type hints, docstrings, reset), and the chat template
    checked to describe them, before any engine starts; (tools, environment class or None)."""
    from .tools import ToolError, check_environment, check_template_renders_tools, check_tools, environment_tools
    from .tools import load_object, set_chat_template, tool_capable_template

    try:
        tools = [load_object(spec, "--tool") for spec in args.tool or ()]
        check_tools(tools)
        environment = load_object(args.environment, "--environment") if args.environment else None
        if environment is not None:
            check_environment(environment)
        described = [*tools, *([getattr(environment, n) for n in environment_tools(environment)] if environment else [])]
        if described or args.chat_template:
            from transformers import AutoTokenizer

            from ..hub import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
            name = f"of {args.model}"
            if args.chat_template:
                set_chat_template(tokenizer, tool_capable_template(args.chat_template))
                name = repr(args.chat_template)
            if described:
                check_template_renders_tools(tokenizer, described, name)
    except ToolError as e:
        parser.error(str(e))
    return tools, environment


def task_settings(args) -> dict:
    """What run.json keeps of the task, so --resume trains on the same data with the same rewards."""
    return {"dataset": args.dataset, "eval_dataset": args.eval_dataset, "rewards": args.reward,
            "reward_weights": args.reward_weights, "tool": args.tool, "environment": args.environment}


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    model_dir, config = _settings(args, parser)

    from ..engine import quiet_vllm_logs
    from . import distributed

    quiet_vllm_logs()  # the progress bar and the summary, not a vLLM INFO line per step
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    world = distributed.init_world("cuda" if _cuda() else "cpu")  # the scheduler makes the tensor-parallel groups
    out = Path(args.out)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not args.model and not args.resume:
            from .toy_task import build_toy_model

            build_toy_model(model_dir, seed=config.seed)
    distributed.barrier(world)
    if config.dtype:
        why = "as in run.json" if args.resume else "as asked"
    else:
        from ..dtype_choice import fastest_dtype

        why = f"auto: {fastest_dtype(world.device).reason}; --dtype to choose"
    config = config.resolve_dtype(world.device)
    if world.is_main:
        print(f"colo.grpo: weights in {config.dtype} ({why})", flush=True)
        if config.tensor_parallel > 1:
            print(f"colo.grpo: tensor parallel {config.tensor_parallel} x data parallel "
                  f"{world.size // config.tensor_parallel}: each rank trains its shards of the weights, views of "
                  "its engine's", flush=True)
        if config.lora_rank:
            print(f"colo.grpo: LoRA rank {config.lora_rank}, alpha {config.lora_alpha:g} on "
                  f"{', '.join(config.lora_spec.targets)}; the base is frozen; adapter in PEFT's format in {out / 'adapter'}",
                  flush=True)
        if config.beta > 0 and not config.lora_rank:
            from transformers import AutoConfig

            from ..kv_sizing import parameter_bytes

            copy_bytes = parameter_bytes(AutoConfig.from_pretrained(model_dir), config.torch_dtype)
            print(f"colo.grpo: --beta {config.beta:g} with full fine-tuning keeps a frozen reference copy of the "
                  f"weights ({copy_bytes / 2**20:.0f} MiB in {config.dtype}, outside the pool) beside the shared one; "
                  "with --lora-rank the reference is the shared base itself, free", flush=True)
        if not args.resume:
            (out / "run.json").write_text(json.dumps({"model": args.model, "model_dir": str(model_dir),
                                                      "config": config.to_dict(),
                                                      "task": task_settings(args),
                                                      "dtype_chosen_because": why}, indent=2))

    from .scheduler import GRPOScheduler

    if args.dataset:
        from .tools import load_object

        loaded = getattr(args, "loaded", None)   # by _check_task_flags (a new run); a resumed one loads here
        if loaded is None:
            loaded = {"rewards": args.reward, "tools": [load_object(spec) for spec in args.tool or ()],
                      "environment": load_object(args.environment, "--environment") if args.environment else None}
        task = dict(dataset=args.dataset, reward_funcs=loaded["rewards"], reward_weights=args.reward_weights,
                    eval_dataset=args.eval_dataset, tools=loaded["tools"], environment_factory=loaded["environment"])
    else:
        from .toy_task import ToyTask

        fields = json.loads((model_dir / "config.json").read_text())
        vocab = fields.get("vocab_size") or fields.get("text_config", {}).get("vocab_size")  # a VLM's language model
        toy = ToyTask(vocab, seed=config.seed)
        task = dict(reward_fn=toy.rewards, prompt_fn=toy.prompts)
    scheduler = GRPOScheduler(model_dir, config=config, **task, out_dir=out, log_path=args.log,
                              trace_path=args.trace, resume=args.resume,
                              engine_options={"enforce_eager": True} if args.eager else None)
    if world.is_main:
        print("colo.grpo: " + ("each step trains a prompt's group as soon as its completions are done, while the "
                               "engine decodes the others (--overlap)" if scheduler.serial_reason is None else
                               f"serial steps ({scheduler.serial_reason})"), flush=True)
    records = []
    try:
        if scheduler.step >= args.steps:
            if world.is_main:
                print(f"colo.grpo: the run in {out} has already done {scheduler.step} steps (--steps {args.steps})")
        else:
            records = scheduler.run(args.steps, progress=not args.no_progress)
    finally:
        scheduler.close()
    distributed.leave_world()  # every rank got here: nothing is left to say to the others
    if world.is_main and records:
        first, last = records[0], records[-1]
        print(f"colo.grpo: steps {first['step']}-{last['step']} done; reward {first['reward_mean']:.3f} -> "
              f"{last['reward_mean']:.3f}; checkpoints in {out}; the model in Hugging Face format in {out / 'final'}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_cli(argv=None) -> int:
    """main() with failures turned into a one-line message and exit status 1 (2 for bad checkpoints)."""
    from ..errors import EnvironmentFailed, NonFiniteGradients
    from .rollout_engine import EngineFailure
    from .scheduler import Terminated

    try:
        return main(argv)
    except CheckpointError as e:
        print(f"colo.grpo: error: {e}", file=sys.stderr)
        return 2
    except (EngineFailure, EnvironmentFailed, NonFiniteGradients, FileNotFoundError, ValueError, MemoryError,
            NotImplementedError, ImportError) as e:
        print(f"colo.grpo: error: {e}", file=sys.stderr)
        return 1
    except Terminated as e:
        print(f"colo.grpo: {e}; continue with --resume", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("colo.grpo: interrupted; the last finished step is checkpointed, continue with --resume",
              file=sys.stderr)
        return 130
