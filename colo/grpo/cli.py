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
import json
import math
import os
import sys
from pathlib import Path

from ..console import LogsToFile
from .checkpoint import CheckpointError, checkpoint_to_resume, list_checkpoints
from .config import GRPOConfig, check_model_dir
from .settings import GROUPS, add_flags, as_flags, positive_int, preset_values, values_from_flags

class _Parser(argparse.ArgumentParser):
    """argparse's parser, its usage errors written to `logs`' terminal streams once the run's output goes to
    its log file (run_cli: the settings are checked after that, vLLM's registry among them)."""
    logs: LogsToFile | None = None

    def _print_message(self, message, file=None):
        if self.logs is not None and message:
            file = self.logs.out if file is sys.stdout else self.logs.err
        super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    """The run's own flags (what to train, on what, where to write), then one flag per GRPOConfig
    setting (colo.grpo.settings: its help, type and default are the config field's)."""
    p = _Parser(prog="python -m colo.grpo", description=__doc__.split("\n", 1)[1].strip(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, required=True, help="total steps of the run (a resumed run counts those done)")
    p.add_argument("--json", dest="log", required=True, metavar="LOG", help="JSON-lines file, one record per step")
    p.add_argument("--out", required=True, metavar="CKPT_DIR", help="directory for checkpoints, run.json and the trained model")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--model", metavar="PATH|ORG/NAME", help="a Hugging Face causal LM directory, or a hub id "
                   "ORG/NAME[@REVISION] (fetched once into the Hugging Face cache; HF_HUB_OFFLINE=1 uses only the "
                   "cache); default: a small random Qwen2")
    p.add_argument("--trace", metavar="FILE", help="Chrome-trace/Perfetto timeline of the phases")
    p.add_argument("--config", metavar="FILE.yaml", help="a YAML mapping of any of these flags (the command line wins)")
    p.add_argument("--eager", action="store_true", help="run the engine without compiling it (starts faster, "
                   "generates slower; vLLM's enforce_eager)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--show-logs", action="store_true", help="print vLLM's, torch's and transformers' own output here "
                   "(default: appended to OUT/logs.txt, the terminal showing colo's lines only)")
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    task = groups["task"]
    task.add_argument("--dataset", metavar="PATH|ORG/NAME", help="training prompts: .jsonl/.json/.parquet/.csv, a "
                      "save_to_disk directory, or a hub dataset ORG/NAME[@REVISION][:CONFIG][:SPLIT] (split default "
                      "train), with a `prompt` column (text or {role, content} messages); needs --model and --reward")
    task.add_argument("--reward", action="append", metavar="SPEC", help="a reward function: FILE.py:NAME, "
                      "module:NAME, math, gsm8k, regex:PATTERN or model:DIR|ORG/NAME (a sequence-classification "
                      "reward model); repeatable, TRL's signature (colo.grpo.rewards)")
    task.add_argument("--reward-model", action="append", metavar="DIR|ORG/NAME",
                      help="a sequence-classification reward model, the same as --reward model:DIR (repeatable)")
    task.add_argument("--reward-weights", type=float, nargs="+", metavar="W", help="one weight per --reward (default 1 each)")
    task.add_argument("--eval-dataset", metavar="PATH|ORG/NAME", help="prompts for greedy pass@1 per reward function "
                      "(as --dataset)")
    agent = groups["agent"]
    agent.add_argument("--tool", action="append", metavar="FILE.py:NAME", help="a function the model may call "
                       "(FILE.py:NAME or module:NAME; sync or async, with type hints and a Google-style docstring, "
                       "described to the model by the chat template); repeatable")
    agent.add_argument("--environment", metavar="FILE.py:CLASS", help="TRL's environment_factory: one instance per "
                       "rollout, reset(**row) before it (a string it returns is appended to the prompt), its public "
                       "methods tools, get_reward() a reward of weight 1 (then --reward is optional)")
    add_flags(groups, GRPOConfig)
    return p


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
    known = _names(parser)
    defaults = {}
    for key, value in loaded.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known:
            parser.error(f"--config: {args.config}: unknown setting {key!r}{_closest(name, parser, yaml=True)}")
        action = known[name]
        try:
            defaults[action.dest] = _config_value(action, name, value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            parser.error(f"--config: {args.config}: {key}: {e}")
    for action in parser._actions:  # required flags the file provides are no longer required
        if action.dest in defaults:
            action.required = False
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)


_SWITCH_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _config_value(action, name: str, value):
    """A --config FILE.yaml value as the flag's own parsing would give it: a switch from true/false
    (YAML's or a word), a list flag from a list or one value, each value through the flag's type and
    choices; a value of the wrong shape is a ValueError saying what the flag takes."""
    if value is None:
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, str) and value.strip().lower() in _SWITCH_WORDS:
            value = _SWITCH_WORDS[value.strip().lower()]
        if not isinstance(value, bool):
            raise ValueError(f"expects true or false, got {value!r}")
        # (no_bias_correction_kl: true is use_bias_correction_kl: false)
        return not value if isinstance(action, argparse._StoreFalseAction) and name != action.dest else value
    if isinstance(value, bool) and action.choices and {"on", "off"} <= set(action.choices):
        value = "on" if value else "off"   # YAML reads on/off as booleans
    listed = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*") or \
        (isinstance(action.nargs, int) and action.nargs > 1)
    if listed:
        values = value if isinstance(value, list) else [value]
        if isinstance(action.nargs, int) and len(values) != action.nargs:
            raise ValueError(f"expects {action.nargs} values, got {value!r}")
        return [_one_value(action, v) for v in values]
    if isinstance(value, list):
        raise ValueError(f"expects one value, got a list {value!r}")
    return _one_value(action, value)


def _one_value(action, value):
    if isinstance(value, (list, dict)):
        if action.type is None:
            raise ValueError(f"expects a single value, got {value!r}")
        value = json.dumps(value)   # a JSON flag's value written as YAML
    out = action.type(str(value)) if action.type is not None else value
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def _names(parser) -> dict:
    """{name: action} for every name a setting goes by: its config field and each of its flags (TRL's
    names among them), with underscores."""
    names = {}
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help", "config"):
            names[action.dest] = action
            names.update({flag.lstrip("-").replace("-", "_"): action for flag in action.option_strings})
    return names


def _closest(name: str, parser, yaml: bool = False) -> str:
    """' (did you mean X?)' for the setting closest to `name` (any name it goes by: a flag, its config
    field), said as a YAML key or a flag, or ''."""
    import difflib

    shown = {key: (key if yaml else action.option_strings[0]) for key, action in _names(parser).items()}
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


def _settings(args, parser) -> tuple[Path, GRPOConfig, tuple | None]:
    """Model directory and config (from the flags for a new run, from OUT/run.json when resuming), and
    the checkpoint a resumed run continues from: each checked here, a usage error naming its flag, and
    not again by the scheduler (colo.grpo.preflight)."""
    out = Path(args.out)
    run_file = out / "run.json"
    from ..hf_format import check_writable

    try:  # before anything loads, not after the first steps
        check_writable(out)
        for flag, path in (("--json", args.log), ("--trace", args.trace)):
            if path is not None:
                check_writable(Path(path).resolve().parent, flag)
                if Path(path).is_dir():
                    raise ValueError(f"{flag} {path} is a directory; it names a file")
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
                saved_dir = resolve_model(saved["model"]) if saved.get("model") else Path(saved["model_dir"])
                if args.model and model_dir.resolve() != saved_dir.resolve():
                    parser.error(f"--resume continues the run with its own model: --model {args.model} is "
                                 f"{model_dir}, the run trains {saved.get('model') or saved_dir}; start a new run "
                                 "in another --out to train another model")
            _refuse_changed_settings(args, saved, config, parser)
            for key, value in (saved.get("task") or {}).items():
                setattr(args, key if key != "rewards" else "reward", value)
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--resume: cannot read {run_file}: {e}")
        if args.tensor_parallel not in (None, config.tensor_parallel):
            parser.error(f"--resume: the run in {out} was trained with --tensor-parallel {config.tensor_parallel}; "
                         f"colo does not re-slice its optimizer state for --tensor-parallel {args.tensor_parallel}: "
                         f"resume with --tensor-parallel {config.tensor_parallel}")
        try:  # fail here, with a clear message, before any engine starts
            resume_from = checkpoint_to_resume(out, lead="")
            check_model_dir(model_dir, config.tensor_parallel, config.lora_spec)
        except (CheckpointError, ValueError, NotImplementedError, FileNotFoundError) as e:
            parser.error(f"--resume: {e}")
        return model_dir, config, resume_from
    if list_checkpoints(out):
        parser.error(f"{out} already holds checkpoints of a run; pass --resume to continue it or choose another --out")
    values = {**preset_values(GRPOConfig, "dataset" if args.dataset else "toy"), **values_from_flags(args, GRPOConfig)}
    # The schedule's length: every optimizer step of the run.
    values["max_steps"] = args.steps * values.get("num_iterations", 1) * values.get("steps_per_generation", 1)
    try:
        config = GRPOConfig(**values)
    except (ValueError, NotImplementedError) as e:
        parser.error(as_flags(str(e), GRPOConfig))
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
            check_model_dir(model_dir, config.tensor_parallel, config.lora_spec)
        except (ValueError, NotImplementedError) as e:
            parser.error(f"--model: {model_dir}: {e}")
    else:
        model_dir = out / "toy-model"  # colo's own, built before the run
    return model_dir, config, None


def _refuse_changed_settings(args, saved: dict, config: GRPOConfig, parser) -> None:
    """A resumed run continues with run.json's settings and task: a flag asking for another one (another
    learning rate, dataset, reward) is refused naming it, not dropped; the same value is fine."""
    def same(a, b):
        return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b

    changed = [f"{name} ({value!r}; the run has {getattr(config, field)!r})"
               for field, (name, value) in _flags_given(args).items()
               if field != "tensor_parallel" and not same(getattr(config, field), value)]
    task = saved.get("task") or {}
    for field in ("dataset", "eval_dataset", "reward_weights", "tool", "environment"):
        value = getattr(args, field, None)
        if value and value != task.get(field):
            changed.append(f"--{field.replace('_', '-')} ({value!r}; the run has {task.get(field)!r})")
    if args.reward and args.reward != task.get("rewards"):
        changed.append(f"--reward ({args.reward!r}; the run has {task.get('rewards')!r})")
    if changed:
        parser.error("--resume continues the run with its own settings (OUT/run.json); these flags ask for others: "
                     + "; ".join(changed) + ". Start a new run in another --out to change them")


def _flags_given(args) -> dict:
    """{config field: (flag, value)} of the GRPOConfig settings the command line (or --config) set."""
    from .settings import flag_of, flagged

    about = flagged(GRPOConfig)
    return {field: (flag_of(field, about[field]), value) for field, value in values_from_flags(args, GRPOConfig).items()}


def _check_task_flags(args, parser) -> None:
    """The dataset flags go together; reward functions and data files are loaded here, before any
    engine starts, so a wrong name fails in a second."""
    from ..hub import load_dataset_spec, pinned
    from .rewards import load_reward
    from .task import PROMPT, RESERVED, check_reward_call

    # --reward-model M is --reward model:M, after the --reward functions (--reward-weights' order)
    args.reward = [*(args.reward or ()), *(f"model:{m}" for m in args.reward_model or ())] or None
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
    if args.reward_weights and not all(math.isfinite(w) for w in args.reward_weights):
        parser.error(f"--reward-weights: {args.reward_weights}: every weight must be a finite number")
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
            if flag == "dataset":
                given = [c for c in columns if c not in RESERVED] + (["environments"] if environment is not None else [])
                try:
                    for function in args.loaded["rewards"]:
                        if callable(function):
                            check_reward_call(function, given, path)
                except ValueError as e:
                    parser.error(f"--reward: {e}")


def load_agent_flags(args, parser):
    """--tool and --environment loaded and checked (type hints, docstrings, reset), and the chat template
    checked to describe them, before any engine starts; (tools, environment class or None)."""
    from .tools import ToolError, check_environment, check_template_renders_tools, check_tools, environment_tools
    from .tools import load_tool_object, set_chat_template, tool_capable_template

    try:
        tools = [load_tool_object(spec, "--tool") for spec in args.tool or ()]
        check_tools(tools)
        environment = load_tool_object(args.environment, "--environment") if args.environment else None
        if environment is not None:
            check_environment(environment)
        described = [*tools, *([getattr(environment, n) for n in environment_tools(environment)] if environment else [])]
        if described or args.chat_template:
            from ..hub import resolve_model
            from .task import load_tokenizer

            tokenizer = load_tokenizer(resolve_model(args.model))
            name = f"of {args.model}"
            if args.chat_template:
                set_chat_template(tokenizer, tool_capable_template(args.chat_template))
                name = repr(args.chat_template)
            if described:
                check_template_renders_tools(tokenizer, described, name)
    except (ToolError, ValueError) as e:
        parser.error(str(e))
    return tools, environment


def task_settings(args) -> dict:
    """What run.json keeps of the task, so --resume trains on the same data with the same rewards."""
    return {"dataset": args.dataset, "eval_dataset": args.eval_dataset, "rewards": args.reward,
            "reward_weights": args.reward_weights, "tool": args.tool, "environment": args.environment}


def main(argv=None) -> int:
    """The run, its errors raised (run_cli reports them), everything printed where it would be anyway."""
    parser = build_parser()
    return _run(parser, parse_args(parser, argv), LogsToFile(None))


def _run(parser, args, logs: LogsToFile) -> int:
    say = logs.out
    model_dir, config, resume_from = _settings(args, parser)

    from ..engine import quiet_vllm_logs
    from . import distributed

    quiet_vllm_logs()  # the progress bar and the summary, not a vLLM INFO line per step
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    world = distributed.init_world("cuda" if _cuda() else "cpu")  # the scheduler makes the tensor-parallel groups
    distributed.check_tensor_parallel(config.tensor_parallel, world.size)  # before the plan below is printed
    out = Path(args.out)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not args.model and not args.resume:
            from .toy_task import build_toy_model

            build_toy_model(model_dir, seed=config.seed)
    distributed.barrier(world)
    logs.settle()   # OUT exists now: the libraries' output goes to OUT/logs.txt
    if config.dtype:
        why = "as in run.json" if args.resume else "as asked"
    else:
        from ..dtype_choice import fastest_dtype

        why = f"auto: {fastest_dtype(world.device).reason}; --dtype to choose"
    config = config.resolve_dtype(world.device, world)  # rank 0's choice, which `why` gives
    if world.is_main:
        print(f"colo.grpo: {_model_line(model_dir, args)}", file=say, flush=True)
        print(f"colo.grpo: weights in {config.dtype} ({why})", file=say, flush=True)
        if config.tensor_parallel > 1:
            print(f"colo.grpo: tensor parallel {config.tensor_parallel} x data parallel "
                  f"{world.size // config.tensor_parallel}: each rank trains its shards of the weights, views of "
                  "its engine's", file=say, flush=True)
        if config.lora_rank:
            print(f"colo.grpo: LoRA rank {config.lora_rank}, alpha {config.lora_alpha:g} on "
                  f"{', '.join(config.lora_spec.targets)}; the base is frozen; adapter in PEFT's format in {out / 'adapter'}",
                  file=say, flush=True)
        if config.beta > 0 and not config.lora_rank:
            from transformers import AutoConfig

            from ..kv_sizing import parameter_bytes

            copy_bytes = parameter_bytes(AutoConfig.from_pretrained(model_dir), config.torch_dtype)
            print(f"colo.grpo: --beta {config.beta:g} with full fine-tuning keeps a frozen reference copy of the "
                  f"weights ({copy_bytes / 2**20:.0f} MiB in {config.dtype}, outside the pool) beside the shared one; "
                  "with --lora-rank the reference is the shared base itself, free", file=say, flush=True)
        if logs.path is not None:
            print(f"colo.grpo: starting the engine; vLLM's and torch's own output goes to {logs.path} "
                  "(--show-logs prints it here)", file=say, flush=True)
        if not args.resume:
            (out / "run.json").write_text(json.dumps({"model": args.model, "model_dir": str(model_dir),
                                                      "config": config.to_dict(),
                                                      "task": task_settings(args),
                                                      "dtype_chosen_because": why}, indent=2))

    from .preflight import CheckedRun
    from .scheduler import GRPOScheduler

    if args.dataset:
        from .tools import load_tool_object

        loaded = getattr(args, "loaded", None)   # by _check_task_flags (a new run); a resumed one loads here
        if loaded is None:
            loaded = {"rewards": args.reward, "tools": [load_tool_object(spec) for spec in args.tool or ()],
                      "environment": load_tool_object(args.environment, "--environment") if args.environment else None}
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
                              engine_options={"enforce_eager": True} if args.eager else None,
                              checked=CheckedRun(model_dir, out, resume_from))
    if world.is_main:
        print(f"colo.grpo: {scheduler.engine.describe()}", file=say, flush=True)
        print("colo.grpo: " + ("each step trains a prompt's group as soon as its completions are done, while the "
                               "engine decodes the others (--overlap)" if scheduler.serial_reason is None else
                               f"serial steps ({scheduler.serial_reason})"), file=say, flush=True)
    records = []
    try:
        if scheduler.step >= args.steps:
            if world.is_main:
                print(f"colo.grpo: the run in {out} has already done {scheduler.step} steps (--steps {args.steps})",
                      file=say)
        else:
            records = scheduler.run(args.steps, progress=not args.no_progress, progress_file=logs.err)
    finally:
        scheduler.close()
    distributed.leave_world()  # every rank got here: nothing is left to say to the others
    if world.is_main and records:
        first, last = records[0], records[-1]
        print(f"colo.grpo: steps {first['step']}-{last['step']} done; reward {first['reward_mean']:.3f} -> "
              f"{last['reward_mean']:.3f}; checkpoints in {out}; the model in Hugging Face format in {out / 'final'}",
              file=say)
    return 0


def _model_line(model_dir: Path, args) -> str:
    """What is trained, on what: the model's architecture and size, and the task."""
    import torch
    from transformers import AutoConfig

    from ..kv_sizing import parameter_bytes

    model_config = AutoConfig.from_pretrained(model_dir)
    architecture = (getattr(model_config, "architectures", None) or [type(model_config).__name__])[0]
    size = parameter_bytes(model_config, torch.float32) / 4
    size = f"{size / 1e9:.1f}B" if size >= 1e9 else f"{size / 1e6:.0f}M"
    task = f"{args.dataset}, rewards {', '.join(map(str, args.reward or ()))}" if args.dataset else "the toy task"
    return f"{args.model or 'a small random Qwen2'} ({architecture}, {size} parameters) on {task}"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_log_path(args) -> Path | None:
    """Where a run's libraries write (vLLM, torch, transformers): OUT/logs.txt, a rank's own beside it under
    torchrun; None with --show-logs (the terminal)."""
    if args.show_logs:
        return None
    rank = int(os.environ.get("RANK", "0"))
    return Path(args.out) / ("logs.txt" if rank == 0 else f"logs.rank{rank}.txt")


def run_cli(argv=None, keep_logs_until_exit: bool = False) -> int:
    """main() with failures turned into a one-line message and exit status 1 (2 for bad arguments and
    checkpoints), the last line on the terminal; the libraries' output in OUT/logs.txt (run_log_path).
    keep_logs_until_exit: what prints after (at interpreter exit) goes to that file too (`python -m colo.grpo`)."""
    parser = build_parser()
    args = parse_args(parser, argv)  # (a usage error exits 2 here, on the terminal)
    try:  # (OUT is made once the run's settings are checked: a refused run leaves none behind)
        logs = LogsToFile(run_log_path(args), create=False)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot write its log there: {e}")
    parser.logs = logs
    try:
        with logs:
            return _reported(lambda: _run(parser, args, logs), logs.err)
    finally:
        if keep_logs_until_exit:
            logs.keep_until_exit()


def _reported(run, err) -> int:
    from ..errors import EnvironmentFailed, NonFiniteGradients
    from ..share_check import EngineMismatch
    from .rollout_engine import EngineFailure
    from .scheduler import Terminated

    try:
        return run()
    except CheckpointError as e:
        print(f"colo.grpo: error: {e}", file=err)
        return 2
    except EngineMismatch as e:
        print(f"colo.grpo: error: {e.message}; --no-share-check trains anyway", file=err)
        return 1
    except (EngineFailure, EnvironmentFailed, NonFiniteGradients, FileNotFoundError, ValueError, MemoryError,
            NotImplementedError, ImportError) as e:
        print(f"colo.grpo: error: {as_flags(str(e), GRPOConfig)}", file=err)
        return 1
    except Terminated as e:
        print(f"colo.grpo: {e}; continue with --resume", file=err)
        return 143
    except KeyboardInterrupt:
        print("colo.grpo: interrupted; the last finished step is checkpointed, continue with --resume", file=err)
        return 130
    except Exception:  # a failure colo has no words for: its traceback where the user sees it
        import traceback

        traceback.print_exc(file=err)
        return 1
