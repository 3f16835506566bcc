"""One definition per setting of a colo.grpo run.

A GRPOConfig field made with `setting()` carries its default, its defaults per preset (the toy task,
a user's dataset), its command-line flag and help, TRL's name for it and, where colo's default is
not TRL's, why. The command line (`add_flags`), the presets (`preset_values`), the keys
`--config FILE.yaml` takes (the flags' names) and the table in docs/grpo.md
(`python -m colo.grpo.settings_docs --write`) are made from those fields; run.json saves the config itself.

A setting's own rule (Integer, Real, OneOf, or a `check=` function) is both its flag's argparse type and the
library's check of its value (check_settings); GRPOConfig.__post_init__ keeps the rules that tie settings together.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..checks import check_int, int_kind
from ..hf_format import save_dtype

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
    # The library's rule for the value (Integer, Real, OneOf, or a function (name, value) raising
    # ValueError); default: `type` where it is a rule, else `choices` where the flag's values are the field's.
    check: Any = None


def setting(default: Any = dataclasses.MISSING, help: str = "", *, group: str, default_factory=dataclasses.MISSING,
            **options) -> Any:
    """A dataclass field with its Setting (see the module's docstring)."""
    if group not in GROUPS:
        raise ValueError(f"setting group must be one of {', '.join(GROUPS)}, got {group!r}")
    about = Setting(help=help, group=group, **options)
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={"setting": about})
    return field(default=default, metadata={"setting": about})


# -- the values a setting takes: argparse's type of its flag and the library's check, one rule -------------
class Integer:
    """An integer no smaller than `minimum` (None too, where `optional`). As argparse's type, the flag's
    text parsed and refused below the minimum; as the library's rule, check_int's message, the setting named
    with `why` beside it."""

    def __init__(self, minimum: int = 1, *, optional: bool = False, why: str = ""):
        self.minimum, self.optional, self.why = minimum, optional, why

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {int_kind(self.minimum)}, got {text!r}") from None
        if value < self.minimum:
            raise argparse.ArgumentTypeError(f"must be at least {self.minimum}, got {value}")
        return value

    def check(self, name: str, value) -> None:
        if value is None and self.optional:
            return
        check_int(value, f"{name} ({self.why})" if self.why else name, self.minimum)


class Real:
    """A number in a range: above or at least `low`, below or at most `high` (None too, where `optional`;
    `why` says what it is, in the message). As argparse's type, the flag's text as a float (the range is the
    library's to check, so its message names the setting: colo.grpo.settings.as_flags turns it into the
    flag)."""

    def __init__(self, *, above: float | None = None, at_least: float | None = None, below: float | None = None,
                 at_most: float | None = None, optional: bool = False, why: str = ""):
        self.low, self.low_open = (above, True) if above is not None else (at_least, False)
        self.high, self.high_open = (below, True) if below is not None else (at_most, False)
        self.optional, self.why = optional, why

    def __call__(self, text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None

    def holds(self, value) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return low_ok and (self.high is None or (value < self.high if self.high_open else value <= self.high))

    def words(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def check(self, name: str, value) -> None:
        if value is None and self.optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.holds(value):
            raise ValueError(f"{name} must be {self.words()}{f' ({self.why})' if self.why else ''}"
                             f"{' or None' if self.optional else ''}, got {value!r}")


class OneOf:
    """One of `values` (a setting's choices; the library's values where its flag's differ)."""

    def __init__(self, values: tuple, why: str = ""):
        self.values, self.why = tuple(values), why

    def check(self, name: str, value) -> None:
        if any(value is v or (type(value) is type(v) and value == v) for v in self.values):
            return
        named = [v for v in self.values if v is not None]
        if len(named) == 1:
            text = repr(named[0])
        elif len(named) == 2 and None not in self.values:
            text = f"{named[0]!r} or {named[1]!r}"
        else:
            text = f"one of {', '.join(map(str, named))}"
        text += " or None" if None in self.values else ""
        raise ValueError(f"{name} must be {text}{f' ({self.why})' if self.why else ''}, got {value!r}")


positive_int = Integer(1)
non_negative_int = Integer(0)
positive_float = Real(above=0)


def json_object(text: str) -> dict:
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
    try:
        save_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--save-dtype: ")) from None
    return text


# -- the settings of a config class -------------------------------------------------------------------
def settings(config_class) -> dict[str, Setting]:
    """{field name: its Setting} for every field of `config_class` made with setting(), in order."""
    return {f.name: f.metadata["setting"] for f in dataclasses.fields(config_class) if "setting" in f.metadata}


def rule_of(about: Setting, default) -> Any:
    """The check a setting's value must pass (None: none of its own)."""
    if about.check is not None:
        return about.check
    if hasattr(about.type, "check"):
        return about.type
    if about.choices is not None and about.from_flag is None:
        return OneOf((*about.choices, *((None,) if default is None else ())))
    if about.action in ("store_true", "store_false"):
        return OneOf((True, False))
    return None


def check_settings(config) -> None:
    """Every setting's value against its own rule (a ValueError naming the first that fails), in the
    fields' order; the rules that tie settings together are the config's. First, NaN or inf in any
    numeric setting is refused naming it: a range passes NaN by no comparison, and an infinite rate or
    decay writes inf into the weights the engine serves."""
    fields = [f for f in dataclasses.fields(config) if "setting" in f.metadata]
    for f in fields:
        value = getattr(config, f.name)
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, tuple) else (value,))):
            raise ValueError(f"{f.name} must be a finite number, got {value}")
    for f in fields:
        rule = rule_of(f.metadata["setting"], f.default)
        if rule is not None:
            (rule.check if hasattr(rule, "check") else rule)(f.name, getattr(config, f.name))


def flag_of(name: str, about: Setting) -> str:
    return about.flag or "--" + name.replace("_", "-")


def as_flags(message: str, config_class) -> str:
    """A library error in the command line's words: each `field=value` of `config_class` as its flag and
    value (`overlap='on'` -> `--overlap on`, a switch's own value -> the switch), and a field named at the
    start of a sentence, or as what one needs, as its flag."""
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
