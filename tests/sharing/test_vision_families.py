"""What colo builds for each vision-language family, without an engine (their vLLM modules or
processors need torchvision, which these CPU machines cannot run: docs/vision.md): the trainer's class
from the config, and the vision tower that is frozen by default, its projector left to train."""
from __future__ import annotations

import pytest
import torch

TINY_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def configs():
    from transformers import (Gemma3Config, Idefics3Config, InternVLConfig, LlavaConfig, Qwen2_5_VLConfig,
                              SmolVLMConfig)

    yield "Qwen2_5_VLForConditionalGeneration", "merger", Qwen2_5_VLConfig(
        text_config=TINY_TEXT, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                  out_hidden_size=64))
    yield "InternVLForConditionalGeneration", "multi_modal_projector", InternVLConfig(
        text_config={**TINY_TEXT, "model_type": "qwen2"}, vision_config={**TINY_VISION, "image_size": 28,
                                                                         "patch_size": 14})
    yield "Gemma3ForConditionalGeneration", "multi_modal_projector", Gemma3Config(
        text_config={**TINY_TEXT, "head_dim": 32}, vision_config={**TINY_VISION, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4)
    yield "SmolVLMForConditionalGeneration", "connector", SmolVLMConfig(
        text_config={**TINY_TEXT, "model_type": "llama"}, vision_config={**TINY_VISION, "image_size": 28,
                                                                         "patch_size": 14})
    yield "Idefics3ForConditionalGeneration", "connector", Idefics3Config(
        text_config={**TINY_TEXT, "model_type": "llama"}, vision_config={**TINY_VISION, "image_size": 28,
                                                                         "patch_size": 14})
    yield "LlavaForConditionalGeneration", "multi_modal_projector", LlavaConfig(
        text_config={**TINY_TEXT, "model_type": "llama"}, vision_config={**TINY_VISION, "image_size": 28,
                                                                         "patch_size": 14})


@pytest.mark.parametrize("expected,projector,config", list(configs()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_trainer_class_and_the_frozen_tower(expected, projector, config):
    from colo.model_classes import is_vision_language, trainer_class_name, vision_tower_parameters
    from colo.shared import check_model_config, meta_model

    config.architectures = [expected]
    check_model_config(config)
    assert is_vision_language(config) and trainer_class_name(config) == expected
    model = meta_model(config, torch.float32)
    assert type(model).__name__ == expected
    tower = {id(p) for p in vision_tower_parameters(model)}
    named = dict(model.named_parameters())
    in_projector = [n for n in named if projector in n.split(".")]
    in_language = [n for n in named if "language_model" in n or "text_model" in n]
    assert tower and in_projector and in_language
    assert not any(id(named[n]) in tower for n in in_projector + in_language)   # the projector trains
