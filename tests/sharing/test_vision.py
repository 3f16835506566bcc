"""A vision-language model through one copy of the weights (a tiny random Idefics3, SmolVLM's architecture,
with SmolLM2's tokenizer; colo.bench.vision_models), one engine for all of the checks:

- every trainer parameter, the vision tower's and the projector's included, is a view of an engine
  tensor; the engine and the trainer give the same log-probabilities on a prompt with an image;
- after an optimizer step and publish(), 0 bytes copied, the engine's log-probabilities on the same
  image prompt follow the trainer's (vLLM's cached image embeddings are forgotten at publish);
- the trained model saved in Hugging Face format loads in transformers with the trained values, its
  processor with it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import colo
from colo.engine import release_llm, weights_region

pytestmark = pytest.mark.slow


def image_prompt_logprobs(llm, model, processor, image, seed: int = 0):
    """(the engine's log-probabilities of 8 sampled tokens after an image prompt, the trainer's of the same)."""
    from vllm import SamplingParams

    from colo.grpo.images import with_image_parts

    messages = with_image_parts([{"role": "user", "content": "What is drawn here?"}], 1)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    banned = {model.config.image_token_id: -100.0}
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}],
                       SamplingParams(max_tokens=8, temperature=1.0, seed=seed, logprobs=0, logit_bias=banned),
                       use_tqdm=False)[0]
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == list(out.prompt_token_ids)   # both processors expand alike
    sampled = list(out.outputs[0].token_ids)
    ids = torch.tensor([list(out.prompt_token_ids) + sampled])
    engine = torch.tensor([step[t].logprob for step, t in zip(out.outputs[0].logprobs, sampled)])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"],
                       pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0, :-1].double()
    trainer = torch.log_softmax(logits, -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-len(sampled):]
    return engine, trainer.float()


def test_vision_language_model_is_one_copy(idefics3_dir, build_engine, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = idefics3_dir
    processor = AutoProcessor.from_pretrained(path)
    image = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
    llm = build_engine(path, skip_tokenizer_init=False)
    try:
        shared = colo.shared_model(llm)
        model = shared.hf_model
        assert type(model).__name__ == "Idefics3ForConditionalGeneration"
        region = weights_region(llm)
        names = [n for n, _ in model.named_parameters()]
        assert any("vision_model" in n for n in names) and any("connector" in n for n in names)
        assert all(region.contains(p) for p in model.parameters())
        assert shared.copy_bytes == 0 and shared.aliased_bytes == sum(p.nbytes for p in model.parameters())
        engine, trainer = image_prompt_logprobs(llm, model, processor, image)
        assert (engine - trainer).abs().max() < 1e-4

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        inputs = processor(text=["<|im_start|>user\n<image>Draw.<|im_end|>\n<|im_start|>assistant\na cat"], images=[[image]],
                           return_tensors="pt")
        labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == model.config.image_token_id, -100)
        model(**inputs, labels=labels).loss.backward()
        assert model.model.vision_model.embeddings.patch_embedding.weight.grad.abs().sum() > 0
        optimizer.step()
        report = shared.publish()
        assert report["bytes_copied"] == 0
        engine_after, trainer_after = image_prompt_logprobs(llm, model, processor, image)
        assert (engine_after - trainer_after).abs().max() < 1e-4
        assert (engine_after - engine).abs().max() > 1e-2   # the step changed what the engine serves

        saved = shared.write_pretrained(tmp_path / "final", shared.full_state_dict(), base_dir=path)
        loaded = AutoModelForImageTextToText.from_pretrained(saved)
        mine = dict(model.named_parameters())
        for name, value in loaded.named_parameters():
            torch.testing.assert_close(value, mine[name].detach(), atol=0, rtol=0, msg=name)
        assert AutoProcessor.from_pretrained(saved).image_token_id == processor.image_token_id
    finally:
        release_llm(llm)
