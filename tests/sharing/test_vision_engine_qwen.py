"""The M-RoPE vision-language families through the engine with one copy of the weights (issue 72):
Qwen2-VL, Qwen2.5-VL and Qwen3-VL, tiny random models with SmolLM2's tokenizer (colo.bench.tiny_vision),
in the dtype `auto` picks on this CPU. Each sends the engine one batch of a one-image prompt and a prompt
of two images of other sizes (their tokens on 2-D rotary grids of different shapes), and compares the
engine with the trainer row by row and with colo.grpo's left-packed batch of the same rows (the model
computes its own 3-D positions there). The rest of what each checks: tests/helpers/vision_engine.py."""
from __future__ import annotations

import pytest

from helpers.vision_engine import check_family

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_family_through_the_engine_with_one_copy(family, tiny_vision_dir, build_engine, tmp_path):
    print(check_family(tiny_vision_dir(family), build_engine, tmp_path))
