"""The engine and the trainer on image prompts: what the vision-language family tests compare.

`compare_on_images` sends rows of images (one chat prompt each) to the engine in one batch, then
computes the trainer's log-probabilities of what it sampled, row by row, and the same weights in fp32
(colo.share_check's reference): a LogprobGap over all rows, judged by the share check's own rule (in
fp32 the gap must be rounding's, about 1e-6; in bf16 within 3x what bf16 rounding makes of the
trainer's model).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch


def noise_image(width: int, height: int, seed: int):
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


@dataclass
class Row:
    engine_prompt: list[int]
    trainer_prompt: list[int]
    sampled: list[int]
    engine: torch.Tensor      # the engine's log-probability of each sampled token
    trainer: torch.Tensor     # the trainer's, in its dtype
    reference: torch.Tensor   # the trainer's weights computed in fp32


def prompt_text(processor, images: int, question: str = "What is drawn here?") -> str:
    from colo.grpo.images import with_image_parts

    messages = with_image_parts([{"role": "user", "content": question}], images)
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def generate(llm, processor, rows: list[list], banned: list[int], seed: int = 0, tokens: int = 8):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True,
                            logit_bias={t: -100.0 for t in banned})
    requests = [{"prompt": prompt_text(processor, len(images)), "multi_modal_data": {"image": images}}
                for images in rows]
    return llm.generate(requests, params, use_tqdm=False)


def trainer_logprobs(model, processor, images: list, ids: list[int], prompt_tokens: int,
                     dtype: torch.dtype | None = None, grad: bool = False, causal: bool = False) -> torch.Tensor:
    """The trainer's log-probabilities of ids[prompt_tokens:] after the prompt with `images` (computed in
    `dtype`: None, the model's own), its processor's tensors laid out as colo.grpo lays them
    (vision_at_columns); causal: attending causally among an image's tokens, as colo.grpo's trainer does
    where the engine does (colo.grpo.images.attending_causally)."""
    from colo.grpo.images import attending_causally, vision_at_columns
    from colo.share_check import computed_in

    inputs = processor(text=[prompt_text(processor, len(images))], images=[images], return_tensors="pt")
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask") and isinstance(v, torch.Tensor)}
    vision = vision_at_columns(attending_causally(vision) if causal else vision, prompt_tokens, prompt_tokens, len(ids))
    with torch.set_grad_enabled(grad), computed_in(model, dtype):
        logits = model(input_ids=torch.tensor([ids]), **vision).logits[0, prompt_tokens - 1:-1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[prompt_tokens:])[:, None])[:, 0].float()


def compare_on_images(llm, model, processor, rows: list[list], banned: list[int], seed: int = 0,
                      causal: bool = False) -> list[Row]:
    out = []
    for images, result in zip(rows, generate(llm, processor, rows, banned, seed)):
        engine_prompt = list(result.prompt_token_ids)
        trainer_prompt = processor(text=[prompt_text(processor, len(images))], images=[images],
                                   return_tensors="pt")["input_ids"][0].tolist()
        sampled = list(result.outputs[0].token_ids)
        engine = torch.tensor([step[t].logprob for step, t in zip(result.outputs[0].logprobs, sampled)])
        ids = engine_prompt + sampled
        if engine_prompt != trainer_prompt:
            out.append(Row(engine_prompt, trainer_prompt, sampled, engine, engine * np.nan, engine * np.nan))
            continue
        trainer = trainer_logprobs(model, processor, images, ids, len(engine_prompt), causal=causal)
        reference = trainer_logprobs(model, processor, images, ids, len(engine_prompt), torch.float32, causal=causal)
        out.append(Row(engine_prompt, trainer_prompt, sampled, engine, trainer, reference))
    return out


def gap_of(rows: list[Row], engine_dtype: torch.dtype):
    """The share check's LogprobGap over every sampled token of the rows."""
    from colo.share_check import LogprobGap, _mean_gap

    engine, trainer, reference = (torch.cat([getattr(r, f) for r in rows]) for f in ("engine", "trainer", "reference"))
    return LogprobGap(engine=_mean_gap(engine, reference), rounding=_mean_gap(trainer, reference),
                      direct=_mean_gap(engine, trainer), tokens=len(engine), dtype=engine_dtype)


# Several images of several sizes in one prompt, and prompts of one and of two images in one batch.
ONE_IMAGE = [noise_image(64, 64, 0)]
TWO_SIZES = [noise_image(56, 84, 1), noise_image(120, 60, 2)]


def config_image_tokens(config) -> set[int]:
    from colo.grpo.images import CONFIG_IMAGE_TOKENS

    return {v for name in CONFIG_IMAGE_TOKENS if isinstance(v := getattr(config, name, None), int)}


def check_family(path, build_engine, tmp_path, several_images: bool = True) -> dict:
    """Everything issue 72 asks of a family through one engine (in the dtype `auto` picks here):
    - every trainer parameter is a view of the engine's tensors, but the vision tower's that vLLM does
      not build (frozen, never served);
    - the engine's log-probabilities on image prompts are the trainer's (the share check's rule);
    - an AdamW step of every trainable parameter and a publish: 0 bytes copied, the engine follows;
    - the tokens of and around an image are the ones colo keeps the engine from sampling;
    - OUT/final loads in transformers (the trained values, the processor) and in vLLM, which serves
      what the trainer trained.
    Returns the figures, for the test's record."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import colo
    from colo.dtype_choice import fastest_dtype
    from colo.engine import release_llm, weights_region
    from colo.grpo.images import placeholder_token_ids

    family = json.loads((path / "config.json").read_text())["model_type"]
    processor = AutoProcessor.from_pretrained(path)
    dtype = fastest_dtype("cpu").dtype
    dtype_name = str(dtype).removeprefix("torch.")
    rows = [ONE_IMAGE, TWO_SIZES] if several_images else [ONE_IMAGE]
    llm = build_engine(path, dtype=dtype_name, skip_tokenizer_init=False)
    try:
        shared = colo.shared_model(llm)
        model = shared.hf_model
        banned = placeholder_token_ids(processor, model.config)
        assert config_image_tokens(model.config) <= set(banned), "an image token the engine may sample"
        region = weights_region(llm)
        apart = [n for n, p in model.named_parameters() if not region.contains(p)]
        tower = {id(p) for p in colo.model_classes.vision_tower_parameters(model)}
        named = dict(model.named_parameters())
        assert all(id(named[n]) in tower and not named[n].requires_grad for n in apart), apart
        assert shared.copy_bytes == 0

        # vLLM's CPU attention has no bidirectional image attention (Gemma 3's): colo.grpo's trainer then
        # attends as the engine does, and so do these comparisons.
        causal = colo.vllm_compat.image_attention_is_causal(llm)
        assert causal == (family == "gemma3")
        before = compare_on_images(llm, model, processor, rows, banned, causal=causal)
        for row in before:
            assert row.engine_prompt == row.trainer_prompt, "vLLM's and transformers' processors expand alike"
            assert not set(row.sampled) & set(banned)
        at_share = gap_of(before, dtype)
        assert at_share.within, at_share.describe()
        packed = packed_gap(model, path, processor, rows, before, dtype, causal)
        assert packed.within, packed.describe()

        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-2)
        ids = before[0].engine_prompt + before[0].sampled
        logprobs = trainer_logprobs(model, processor, ONE_IMAGE, ids, len(before[0].engine_prompt), grad=True,
                                    causal=causal)
        (-logprobs.sum()).backward()
        optimizer.step()
        report = shared.publish()
        assert report["bytes_copied"] == 0
        after = compare_on_images(llm, model, processor, rows, banned, causal=causal)
        after_publish = gap_of(after, dtype)
        assert after_publish.within, after_publish.describe()
        moved = trainer_logprobs(model, processor, ONE_IMAGE, ids, len(before[0].engine_prompt), causal=causal) \
            - before[0].trainer
        assert moved.abs().max() > 1e-2, "the step changed the model the engine now serves"

        final = shared.write_pretrained(tmp_path / "final", shared.full_state_dict(), base_dir=path)
        loaded = AutoModelForImageTextToText.from_pretrained(final, dtype=dtype)
        for name, value in loaded.named_parameters():
            torch.testing.assert_close(value, named[name].detach(), atol=0, rtol=0, msg=name)
        assert AutoProcessor.from_pretrained(final).chat_template == processor.chat_template
    finally:
        release_llm(llm)
    del shared, model
    served = build_engine(final, dtype=dtype_name, skip_tokenizer_init=False)
    try:
        again = generate(served, processor, rows, banned)
        for result, row in zip(again, after):
            assert list(result.outputs[0].token_ids) == row.sampled   # the same weights, the same samples
            engine = torch.tensor([s[t].logprob for s, t in zip(result.outputs[0].logprobs, row.sampled)])
            torch.testing.assert_close(engine, row.engine, atol=1e-5, rtol=0)
    finally:
        release_llm(served)
    return {"family": family, "dtype": str(dtype), "at_share": at_share.summary(), "packed": packed.summary(),
            "after_publish": after_publish.summary(), "direct": max(at_share.direct, after_publish.direct),
            "frozen_apart": len(apart)}



def packed_gap(model, path, processor, rows: list[list], compared: list[Row], dtype: torch.dtype, causal: bool):
    """colo.grpo's own trainer path on the same rows: each prompt rendered as the task renders it
    (ImagePrompts), the rows left-packed into one batch with the engine's completions (colo.grpo.batch),
    one forward; its log-probabilities against the fp32 reference of each row alone."""
    from colo.grpo.batch import completion_logprobs, pack
    from colo.grpo.images import ImagePrompts

    prompts = ImagePrompts(path, processor)
    prompts.causal_images = causal
    rendered = [prompts.render([{"role": "user", "content": "What is drawn here?"}], images, f"row {i}", {})
                for i, images in enumerate(rows)]
    assert [list(p) for p in rendered] == [r.engine_prompt for r in compared]
    batch = pack(rendered, [r.sampled for r in compared])
    with torch.no_grad():
        logprobs = completion_logprobs(model, batch)
    packed = [logprobs[i, :len(r.sampled)] for i, r in enumerate(compared)]
    return gap_of([Row(r.engine_prompt, r.trainer_prompt, r.sampled, p, r.trainer, r.reference)
                   for p, r in zip(packed, compared)], dtype)
