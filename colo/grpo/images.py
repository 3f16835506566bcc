"""Prompts with images (vision-language models), in TRL's conventions.

A dataset with an `image` column (one image per row) or an `images` column (a list per row) of PIL
images, file paths or bytes (a hub dataset's Image feature gives PIL images) trains a vision-language
model: as TRL's GRPOTrainer does (trl/data_utils.py, prepare_multimodal_messages), the row's images
go in front of the text of the first user message as `{"type": "image"}` parts, and the model's
processor (AutoProcessor) renders the chat and expands each image into its placeholder tokens.

An `ImagePrompt` is that expanded token list, what the trainer sees (so batching, lengths and checks
stay token lists), carrying the two other forms of the same prompt:
- `engine_input`, what vLLM is given: the rendered text and the images (`multi_modal_data`); vLLM's own
  processor expands them, and the engine's prompt ids are checked against the trainer's once
  (rollout_engine), so both always see the same sequence;
- `vision`, the processor's tensors for the trainer's forward (pixel values, grid sizes, masks: the
  model's own keyword arguments), made when the prompt is batched, not kept for the whole dataset.

Image placeholder tokens are in the prompt only: the engine is kept from sampling them (TRL's
`suppress_tokens` for the image token) and they never count in the loss.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch

IMAGE_COLUMNS = ("image", "images")
VIDEO_COLUMNS = ("video", "videos")   # TRL's names; refused (not supported yet)


class ImagePrompt(list):
    """A prompt's token ids as the trainer sees them (image placeholders expanded), with the engine's
    input (`engine_input`) and the processor's tensors (`vision`, batch dimension 1)."""

    def __init__(self, ids, engine_input: dict, vision: dict[str, torch.Tensor]):
        super().__init__(int(t) for t in ids)
        self.engine_input, self.vision = engine_input, vision


def image_column(columns) -> str | None:
    """The dataset's image column (TRL's names), or None; both is an error."""
    found = [c for c in IMAGE_COLUMNS if c in columns]
    if len(found) > 1:
        raise ValueError("the dataset has both an `image` and an `images` column; TRL's convention is one of them")
    return found[0] if found else None


def load_image(value, where: str):
    """A PIL RGB image from a PIL image, a file path, raw bytes or a datasets Image dict ({bytes, path})."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (str, Path)):
            image = Image.open(value)
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        else:
            raise ValueError(f"{where}: an image must be a PIL image, a file path or bytes, got {type(value).__name__}")
        return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise ValueError(f"{where}: cannot read the image ({e})") from None


def row_images(value, column: str, where: str) -> list:
    """The row's images as a list (an `image` column holds one, an `images` column a list); none (None,
    an empty list) for a text-only row, which trains beside the rows with images."""
    if value is None:
        return []
    values = [value] if column == "image" else list(value)
    return [load_image(v, f"{where}, {column}") for v in values]


def with_image_parts(messages: list[dict], count: int) -> list[dict]:
    """TRL's rule (prepare_multimodal_messages): `count` image parts before the text of the first user
    message whose content is text; every other text content becomes a text part. Messages that already
    carry image parts keep them."""
    out, placed = [], False
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if message["role"] == "user" and not placed:
                parts = [{"type": "image"} for _ in range(count)] + parts
                placed = True
            message = {**message, "content": parts}
        out.append(message)
    return out


def count_image_parts(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


# Processor outputs that make transformers attend both ways among an image's tokens (Gemma 3's).
BOTH_WAYS_FIELDS = ("token_type_ids",)


def attending_causally(vision: dict) -> dict:
    """A prompt's processor tensors (or a forward's keywords) for a trainer that attends among an image's
    tokens causally, as an engine without bidirectional image attention does (vLLM's CPU backend on
    Gemma 3): its both-ways fields all text (0)."""
    return {k: v.new_zeros(v.shape) if k in BOTH_WAYS_FIELDS and isinstance(v, torch.Tensor) else v
            for k, v in vision.items()}


class ImagePrompts:
    """Renders a dataset's chat prompts with their images through the model's processor.
    causal_images: the trainer attends causally among an image's tokens, as the engine does
    (colo.vllm_compat.image_attention_is_causal), so it trains on what the engine sampled from."""

    causal_images = False

    def __init__(self, model_dir, processor=None):
        if processor is None:
            processor = load_processor(model_dir)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.placeholder_ids = placeholder_token_ids(processor, _model_config(model_dir))

    def render(self, messages: list[dict], images: list, where: str, template_kwargs: dict) -> ImagePrompt:
        messages = with_image_parts(messages, len(images)) if count_image_parts(messages) == 0 else messages
        placeholders = count_image_parts(messages)
        if placeholders != len(images):
            raise ValueError(f"{where}: {len(images)} images for {placeholders} image placeholders in the messages")
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **template_kwargs)
        if not images:   # a text-only row: the processor's tokens, no image for the engine
            inputs = self.processor(text=[text], return_tensors="pt")
            return ImagePrompt(inputs["input_ids"][0].tolist(), {"prompt": text}, {})
        inputs = self.processor(text=[text], images=[images], return_tensors="pt")
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask", None)
        vision = {key: value for key, value in inputs.items() if isinstance(value, torch.Tensor)}
        if self.causal_images:
            vision = attending_causally(vision)
        return ImagePrompt(ids, {"prompt": text, "multi_modal_data": {"image": images}}, vision)


def load_processor(model_dir):
    """The model's AutoProcessor; a clear error where the directory has none or it has no image processor."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{model_dir}: no processor for the images ({e}); a vision-language model directory "
                         "holds its processor's files (processor_config.json or preprocessor_config.json)") from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise ValueError(f"{model_dir}: the processor ({type(processor).__name__}) has no image processor and "
                         "tokenizer; a vision-language model directory holds its processor's files")
    return processor


def _model_config(model_dir):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


# The model config's names of the tokens around and in place of an image (Qwen2-VL's vision start and
# end, which its processor does not name; Gemma 3's begin and end of image; LLaVA's image index).
CONFIG_IMAGE_TOKENS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                       "vision_start_token_id", "vision_end_token_id", "boi_token_index", "eoi_token_index")


def placeholder_token_ids(processor, config=None) -> list[int]:
    """The tokens a processor puts in place of an image, or around it, and those the model's config
    names so (the engine must not sample them)."""
    tokenizer = processor.tokenizer
    ids = {value for name in CONFIG_IMAGE_TOKENS if isinstance(value := getattr(config, name, None), int)
           and 0 <= value < len(tokenizer)}
    # The names transformers' processors and multimodal tokenizers give them (Idefics3's fake token and
    # global tag, Gemma 3's begin/end of image, Qwen-VL's vision start/end and pads).
    names = ("image_token_id", "image_token", "video_token", "boi_token", "eoi_token", "image_start_token",
             "image_end_token", "vision_start_token", "vision_end_token", "fake_image_token", "global_image_tag")
    for holder in (processor, tokenizer):
        for name in names:
            value = getattr(holder, name, None) if not (holder is tokenizer and name.endswith("_id")) else None
            if isinstance(value, str):
                value = tokenizer.convert_tokens_to_ids(value)
            if isinstance(value, int) and value != tokenizer.unk_token_id and 0 <= value < len(tokenizer):
                ids.add(value)
    return sorted(ids)


# Processor outputs with one entry per prompt token: which tokens are an image's (Qwen2-VL's family
# computes its 3-D rotary positions from them, Gemma 3 attends both ways among them).
PER_TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")


def vision_at_columns(vision: dict, prompt_tokens: int, prompt_columns: int, width: int) -> dict:
    """A row's processor tensors with its per-token fields laid out as the packed row is: the prompt
    left-padded to `prompt_columns`, the completion after it (0: text) up to `width`."""
    out = dict(vision)
    for key in PER_TOKEN_FIELDS:
        if key in vision:
            row = vision[key].new_zeros((1, width))
            row[0, prompt_columns - prompt_tokens:prompt_columns] = vision[key].reshape(-1)
            out[key] = row
    return out


def batched_vision(visions: list) -> dict[str, torch.Tensor]:
    """The processor tensors of several prompts as one forward's keyword arguments: each concatenated
    along its first dimension (a batch of prompts, or of images or patches), trailing dimensions padded
    with zeros where the prompts' differ (an Idefics3 row with fewer images: an all-zero image is the
    processor's own padding, which the model skips). Text-only rows (no tensors) add no image; their
    per-token fields are all text (0), so each row still has one."""
    present = [v for v in visions if v]
    if not present:
        return {}
    out = {}
    for key in dict.fromkeys(k for v in present for k in v):
        if key in PER_TOKEN_FIELDS:
            like = next(v[key] for v in present if key in v)
            tensors = [v[key] if v and key in v else like.new_zeros(like.shape) for v in visions]
        else:
            tensors = [v[key] for v in present if key in v]
        if tensors[0].dim() > 1 and len({t.shape[1:] for t in tensors}) > 1:
            shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
            padded = []
            for t in tensors:
                grown = t.new_zeros((t.shape[0], *shape))
                grown[(slice(None), *[slice(0, n) for n in t.shape[1:]])] = t
                padded.append(grown)
            tensors = padded
        out[key] = torch.cat(tensors)
    return out
