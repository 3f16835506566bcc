"""What colo builds for each vision-language family, without an engine: the trainer's class from the
config, and the vision tower that is frozen by default, its projector left to train; and the M-RoPE
trainer path on a packed batch. The families through the engine: test_vision_engine_qwen.py and
test_vision_engine_families.py."""
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


def test_rotary_positions_a_model_computes_from_its_image_grids_are_its_own():
    """Qwen2-VL-style models (M-RoPE) place an image's tokens on a 2-D grid of rotary positions and count
    the text after it from there (from the processor's mm_token_type_ids); 1-D position ids counted per
    token would put them elsewhere. colo's log-probabilities of a left-packed batch of image prompts
    (colo.grpo.batch.pack, both log-probability paths) equal each row's own forward."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from colo.grpo.batch import completion_logprobs, pack
    from colo.grpo.images import ImagePrompt
    from colo.grpo.logprobs import full_logits_logprobs

    image, start, end = 500, 502, 503
    config = Qwen2_5_VLConfig(text_config={**TINY_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
                              vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 out_hidden_size=64, spatial_merge_size=2, patch_size=14,
                                                 temporal_patch_size=2),
                              image_token_id=image, video_token_id=501, vision_start_token_id=start,
                              vision_end_token_id=end)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    grid = torch.tensor([[1, 4, 8]])          # 32 patches, 8 image tokens after the 2x2 merge, 2 x 4 of them
    token_ids = [[7, start, *[image] * 8, end, 9, 11], [3, 4, 5, 6, start, *[image] * 8, end, 12]]
    completions = [[20, 21, 22], [23, 24]]
    rows = []
    for ids in token_ids:
        vision = {"pixel_values": torch.randn(32, 3 * 2 * 14 * 14), "image_grid_thw": grid,
                  "mm_token_type_ids": torch.tensor([[int(t == image) for t in ids]])}
        rows.append(ImagePrompt(ids, {}, vision))
    batch = pack(rows, completions)
    with torch.no_grad():
        ours = [completion_logprobs(model, batch),      # the chunked head (a plain tied head)
                full_logits_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                     batch.completion_ids, model_inputs=batch.model_inputs())]
        for row, (prompt, completion) in enumerate(zip(rows, completions)):
            ids = torch.tensor([list(prompt) + completion])
            kinds = torch.cat([prompt.vision["mm_token_type_ids"], torch.zeros(1, len(completion), dtype=torch.long)], 1)
            logits = model(input_ids=ids, pixel_values=prompt.vision["pixel_values"], image_grid_thw=grid,
                           mm_token_type_ids=kinds).logits[0, len(prompt) - 1:-1]
            alone = logits.float().log_softmax(-1).gather(1, ids[0, len(prompt):, None])[:, 0]
            for logprobs in ours:
                torch.testing.assert_close(logprobs[row, :len(completion)], alone, atol=1e-5, rtol=0)
