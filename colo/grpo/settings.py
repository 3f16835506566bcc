"""One definition per setting of a colo.grpo run.

A GRPOConfig field made with `setting()` carries its default, its defaults per preset (the toy task,
a user's dataset), its command-line flag and help, TRL's name for it and, where colo's default is
not TRL's, why. The command line (`add_flags`), the presets (`preset_values`), the keys
`--config FILE.yaml` takes (the flags' names) and the table in docs/grpo.md
(`python -m colo.grpo.settings_docs --write`) are made from those fields; run.json saves the config itself.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

# The --help sections the settings go under, in order: key -> title.
GROUPS = {
    "task": "the task (default: the toy task)",
    "agent": "agentic rollouts: tools, environments and several turns (TRL's conventions; with --dataset)",
    "generation": "generation (defaults: the toy's, or TRL's with --dataset)",
    "loss": "the loss and its variants (TRL's names)",
    "optimizer": "optimizer (TRL's names)",
    "memory": "memory, precision and parallelism",
    "saving": "checkpoints, the trained model (Hugging Face format: OUT/final at the end of the run) and trackers",
}
PRESETS = ("toy", "dataset")


@dataclass(frozen=True)
class Setting:
    help: str
    group: str
    flag: str = ""                         # default: the field's name, dashed
    aliases: tuple[str, ...] = ()          # more flags for it: TRL's name where colo's differs
    type: Callable | None = None           # argparse's type of the flag's value
    choices: tuple | None = None
    metavar: str | tuple | None = None
    nargs: str | int | None = None
    action: str = "store"                  # or "store_true", "store_false"
    from_flag: Callable | None = None      # the flag's value -> the field's (e.g. "on" -> True)
    presets: dict = field(default_factory=dict)   # preset -> its default, where it is not the field's
    trl: str | None = None                 # the name in TRL's GRPOConfig, where TRL has the setting
    not_trls_default: str = ""             # why colo's default differs from TRL's
    default_text: str = ""                 # the docs' default, where the value needs words
    cli: bool = True                       # False: a library field no flag sets (a preset's own)


def setting(default: Any = dataclasses.MISSING, help: str = "", *, group: str, default_factory=dataclasses.MISSING,
            **options) -> Any:
    """A dataclass field with its Setting (see the module's docstring)."""
    if group not in GROUPS:
        raise ValueError(f"setting group must be one of {', '.join(GROUPS)}, got {group!r}")
    about = Setting(help=help, group=group, **options)
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={"setting": about})
    return field(default=default, metadata={"setting": about})


# -- the flags' value types (argparse's `type`) ---------------------------------------------------------
def int_at_least(minimum: int):
    """An argparse type: an integer no smaller than `minimum`."""
    from ..checks import int_kind

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


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def thread_pair(text: str) -> tuple[int, int]:
    """"E,T": two positive integers."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected ENGINE,TRAINER (two positive integers), got {text!r}")
    return tuple(positive_int(part.strip()) for part in parts)


def save_dtype_name(text: str) -> str:
    from ..hf_format import save_dtype

    try:
        save_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--save-dtype: ")) from None
    return text


# -- the settings of a config class -------------------------------------------------------------------
def settings(config_class) -> dict[str, Setting]:
    """{field name: its Setting} for every field of `config_class` made with setting(), in order."""
    return {f.name: f.metadata["setting"] for f in dataclasses.fields(config_class) if "setting" in f.metadata}


def flag_of(name: str, about: Setting) -> str:
    return about.flag or "--" + name.replace("_", "-")


def as_flags(message: str, config_class) -> str:
    """A library error in the command line's words: each `field=value` of `config_class` as its flag and
    value (`overlap='on'` -> `--overlap on`, a switch's own value -> the switch), and a field named at the
    start of a sentence, or as what one needs, as its flag."""
    import re

    about = flagged(config_class)

    def assignment(match) -> str:
        name, value = match.group(1), match.group(2).strip("'\"")
        if name not in about:
            return match.group(0)
        flag, action = flag_of(name, about[name]), about[name].action
        if (action, value) in (("store_true", "True"), ("store_false", "False")):
            return flag
        return f"{flag} {value}"

    def named(match) -> str:
        name = match.group(2)
        return match.group(1) + (flag_of(name, about[name]) if name in about else name)

    message = re.sub(r"\b([a-z][a-z0-9_]*)=('[^']*'|\"[^\"]*\"|[^\s,;:)]+)", assignment, message)
    message = re.sub(r"(^|; |\. )([a-z][a-z0-9_]*)(?= must | needs )", named, message)
    return re.sub(r"( needs )([a-z][a-z0-9_]*)\b", named, message)


def field_default(config_class, name: str):
    f = next(f for f in dataclasses.fields(config_class) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def preset_values(config_class, preset: str) -> dict:
    """{field: value} of the preset's own defaults."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    return {name: about.presets[preset] for name, about in settings(config_class).items() if preset in about.presets}


def add_flags(groups: dict[str, argparse._ArgumentGroup], config_class) -> None:
    """One flag per setting (its aliases too), in its group; every default None, so that a flag not
    given leaves the preset's or the field's default."""
    for name, about in flagged(config_class).items():
        options: dict[str, Any] = dict(dest=name, default=None, help=about.help)
        if about.action != "store":
            options["action"] = about.action
        if about.action not in ("store_true", "store_false"):
            options.update({key: value for key, value in (("type", about.type), ("choices", about.choices),
                                                          ("metavar", about.metavar), ("nargs", about.nargs))
                            if value is not None})
        groups[about.group].add_argument(flag_of(name, about), *about.aliases, **options)


def flagged(config_class) -> dict[str, Setting]:
    """The settings a flag sets."""
    return {name: about for name, about in settings(config_class).items() if about.cli}


def values_from_flags(args: argparse.Namespace, config_class) -> dict:
    """{field: value} of every setting whose flag was given (or came from --config FILE.yaml)."""
    values = {}
    for name, about in flagged(config_class).items():
        value = getattr(args, name, None)
        if value is not None:
            values[name] = about.from_flag(value) if about.from_flag else value
    return values


def default_text(config_class, name: str, about: Setting) -> str:
    """The docs' default of a setting: its words, else its value and the presets' own."""
    if about.default_text:
        return about.default_text

    def shown(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str):
            return f"`{value}`"
        if isinstance(value, (tuple, list)):
            return " ".join(str(v) for v in value) or "-"
        return str(value)

    text = shown(field_default(config_class, name))
    if "toy" in about.presets:
        text = f"{shown(about.presets['toy'])} (toy)"
    if "dataset" in about.presets:
        text += f"; {shown(about.presets['dataset'])} with `--dataset`"
    return text


def docs_table(config_class) -> str:
    """The settings' table in docs/grpo.md: flag, default, what it does, TRL's name (and why colo's
    default is not TRL's, where it is not)."""
    rows = ["| flag | default | what it does | TRL |", "|---|---|---|---|"]
    for name, about in flagged(config_class).items():
        flags = ", ".join(f"`{flag}`" for flag in (flag_of(name, about), *about.aliases))
        metavar = about.metavar if isinstance(about.metavar, str) else " ".join(about.metavar or ())
        if metavar:
            flags = flags.replace(f"`{flag_of(name, about)}`", f"`{flag_of(name, about)} {metavar}`", 1)
        trl = f"`{about.trl}`" if about.trl else "-"
        if about.not_trls_default:
            trl += f" (another default: {about.not_trls_default})"
        cell = about.help.replace("|", "\\|")
        rows.append(f"| {flags.replace('|', chr(92) + '|')} | {default_text(config_class, name, about)} | {cell} | {trl} |")
    return "\n".join(rows) + "\n"
