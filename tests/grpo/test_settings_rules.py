"""Each setting's range or choices are declared once, in its setting(): the library's GRPOConfig refuses a
value outside them naming the setting, and the command line parses the flag with the same rule."""
import argparse
import dataclasses

import pytest

from colo.grpo.config import GRPOConfig
from colo.grpo.settings import Integer, OneOf, Real, rule_of, settings

# Numbers without a rule of their own: lora_alpha is checked with the adapter's other settings
# (colo.lora.LoraSpec, through GRPOConfig.lora_spec), the rest take any value.
FREE_NUMBERS = {"lora_alpha", "delta"}


def rules():
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    return {name: rule_of(about, defaults[name]) for name, about in settings(GRPOConfig).items()}


def outside(rule):
    """A value the rule refuses."""
    if isinstance(rule, Integer):
        return rule.minimum - 1
    if isinstance(rule, Real):
        if rule.low is not None:
            return rule.low if rule.low_open else rule.low - 1.0
        return rule.high if rule.high_open else rule.high + 1.0
    return "not-one-of-them"


def test_every_number_and_choice_setting_declares_its_rule():
    declared = rules()
    numbers = [f.name for f in dataclasses.fields(GRPOConfig)
               if any(t in str(f.type) for t in ("int", "float")) and f.name not in FREE_NUMBERS]
    assert numbers and [n for n in numbers if declared[n] is None] == []
    choices = [name for name, about in settings(GRPOConfig).items() if about.choices]
    assert choices and [n for n in choices if declared[n] is None] == []


@pytest.mark.parametrize("name", [n for n, r in rules().items() if isinstance(r, (Integer, Real, OneOf))])
def test_a_value_outside_a_settings_rule_is_refused_naming_it(name):
    bad = outside(rules()[name])
    with pytest.raises(ValueError, match=f"^{name}( \\(.*\\))? must be"):
        GRPOConfig(**{name: bad})


def test_the_flag_parses_with_the_settings_rule():
    num_generations = rules()["num_generations"]
    assert num_generations("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match="must be at least 2, got 1"):
        num_generations("1")
    with pytest.raises(ValueError, match=r"num_generations \(completions per prompt.*an integer >= 2, got 1"):
        GRPOConfig(num_generations=1)
    top_p = rules()["top_p"]
    assert top_p("0.5") == 0.5 and top_p.words() == "in (0, 1]"
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number, got 'half'"):
        top_p("half")


def test_switches_take_booleans_and_optional_settings_none():
    with pytest.raises(ValueError, match="shard_optimizer must be True or False, got 1"):
        GRPOConfig(shard_optimizer=1)
    with pytest.raises(ValueError, match="truncate_prompts must be 'left' or None, got 'right'"):
        GRPOConfig(truncate_prompts="right")
    config = GRPOConfig(max_grad_norm=None, min_p=None, micro_batch_size=None, tool_timeout=None)
    assert (config.max_grad_norm, config.micro_batch_size) == (None, None)
