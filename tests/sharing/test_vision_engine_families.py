"""The seeds' vision-language families through the engine with one copy of the weights (issue 72):
InternVL (transformers' format), Gemma 3, LLaVA, LLaVA-OneVision and Mistral 3, tiny random models with
real tokenizers (colo.bench.tiny_vision), in the dtype `auto` picks on this CPU. What each checks:
tests/helpers/vision_engine.py, check_family. The M-RoPE families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL):
test_vision_engine_qwen.py."""
from __future__ import annotations

import pytest

from helpers.vision_engine import check_family

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["internvl", "gemma3", "llava", "mistral3"])
def test_family_through_the_engine_with_one_copy(family, tiny_vision_dir, build_engine, tmp_path):
    print(check_family(tiny_vision_dir(family), build_engine, tmp_path))


def test_llava_onevision_through_the_engine_with_one_copy(tiny_vision_dir, build_engine, tmp_path):
    """One image a prompt: vLLM 0.32 expands a prompt of several images with each image's "anyres"
    tiles, transformers 5.19 with each image's base view only (colo.grpo refuses such rows, naming them:
    test_llava_onevision_several_images_are_refused)."""
    print(check_family(tiny_vision_dir("llava_onevision"), build_engine, tmp_path, several_images=False))
