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


def test_a_vision_language_engine_for_colo_trl_reads_its_checkpoint(tiny_vision_dir, build_engine):
    """colo.trl builds its engine with vLLM's dummy loader for text models (share_weights writes the
    trainer's weights in), but it reads the checkpoint for a vision-language model: the dummy loader also
    randomizes modules' persistent buffers that no weight fills, as one of Qwen2.5-VL's vision tower, and
    share_weights then leaves it random (the text-only share check does not see it)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import colo
    from colo.engine import release_llm
    from colo.trl import _load_format
    from helpers.vision_engine import ONE_IMAGE, compare_on_images

    path = tiny_vision_dir("qwen2_5_vl")
    processor = AutoProcessor.from_pretrained(path)
    assert _load_format(AutoModelForImageTextToText.from_pretrained(path).config) == "auto"
    gaps = {}
    for load_format in ("dummy", "auto"):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        llm = build_engine(path, skip_tokenizer_init=False, load_format=load_format)
        try:
            colo.share_weights(model, llm)
            row = compare_on_images(llm, model, processor, [ONE_IMAGE], [])[0]
            gaps[load_format] = float((row.engine - row.trainer).abs().max())
        finally:
            release_llm(llm)
    assert gaps["auto"] < 1e-4 < 1e-2 < gaps["dummy"], gaps
