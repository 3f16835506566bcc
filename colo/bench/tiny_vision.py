"""Tiny random vision-language models of each family vLLM serves here, built offline from transformers'
config and processor classes, with a real tokenizer: SmolLM2-135M-Instruct's (colo.smollm2), its chat
format (ChatML) and the family's image tokens added, so prompts, EOS and the vocabulary are real ones.

`tiny_vision_model(family, directory)` writes the model and its processor (returned: the directory);
`FAMILIES` names them (transformers' model types). Each takes images of any size: the processors resize
or tile them to a few image tokens (4 to 40), small enough for a 2-core CPU engine. Idefics3 (SmolVLM's
architecture) is colo.bench.vision_models'. transformers and torch are imported inside the builders,
so that importing colo.bench stays light.
"""
from __future__ import annotations

from pathlib import Path

from ..hf_names import keep_checkpoint_names
from .vision_models import CHAT_TEMPLATE, take_language_model

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "gemma3", "llava", "llava_onevision", "mistral3")

# What each family writes for an image part of a chat message (its checkpoints' chat templates).
IMAGE_TEXT = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "internvl": "<IMG_CONTEXT>\n",
    "gemma3": "<start_of_image>",
    "llava": "<image>",
    "mistral3": "[IMG]",
}
IMAGE_TEXT.update(qwen2_5_vl=IMAGE_TEXT["qwen2_vl"], qwen3_vl=IMAGE_TEXT["qwen2_vl"],
                  llava_onevision=IMAGE_TEXT["llava"])
# Gemma's chat format (its checkpoints' template, system prompts left out): the assistant is "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH = 14
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)


def _tokenizer(extra_special_tokens: dict | None = None, added: tuple = ()):
    """SmolLM2's tokenizer with a family's image tokens: `added` as plain special tokens,
    `extra_special_tokens` ({attribute: token}) also as the tokenizer's named attributes, which some
    processors read (InternVL's `start_image_token`, Gemma 3's `boi_token`)."""
    from transformers import AutoTokenizer

    from ..smollm2 import smollm2_dir

    kwargs = {"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), **kwargs)
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": list(added)})
    return tokenizer


def _text_config(tokenizer, hidden_size: int, layers: int, **extra) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=hidden_size // 64, num_key_value_heads=1,
                head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, **extra)


def _qwen_vl(family: str, hidden_size: int, layers: int):
    from transformers import (Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen3VLConfig, Qwen3VLProcessor)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = _tokenizer(added=QWEN_TOKENS)
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS))
    patch = 16 if family == "qwen3_vl" else PATCH
    # 4 to 16 merged tokens an image: its pixels kept between 2 x 2 and 4 x 4 merged 2 x 2 patches.
    size = {"shortest_edge": (2 * 2 * patch) ** 2, "longest_edge": (4 * 2 * patch) ** 2}
    pixels = dict(size=size, patch_size=patch, merge_size=2, temporal_patch_size=2)
    # M-RoPE: the rotary half of each head (32) split over time, height and width.
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}
    ids = dict(image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    text = _text_config(tokenizer, hidden_size, layers, rope_parameters=rope)
    vision = dict(depth=2, num_heads=2, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        config = Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": 64, "mlp_ratio": 2,
                                                                 "hidden_size": hidden_size}, **ids)
    elif family == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(text_config=text, vision_config={
            **vision, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": hidden_size,
            "window_size": 4 * patch, "fullatt_block_indexes": [1]}, **ids)
    else:
        rope["mrope_interleaved"] = True
        config = Qwen3VLConfig(text_config=text, vision_config={
            **vision, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": hidden_size,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}, **ids)
    video_class = Qwen3VLVideoProcessor if family == "qwen3_vl" else Qwen2VLVideoProcessor
    processor_class = Qwen3VLProcessor if family == "qwen3_vl" else Qwen2VLProcessor
    processor = processor_class(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                video_processor=video_class(**pixels))
    return config, processor


def _internvl(hidden_size: int, layers: int):
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    tokenizer = _tokenizer({"start_image_token": "<img>", "end_image_token": "</img>",
                            "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    tile = 4 * PATCH   # a 56-pixel tile: 16 patches, 4 tokens after InternVL's 0.5 pixel shuffle
    # Tiled as InternVL2.5's processor does (up to 4 tiles and a thumbnail here, 12 in the checkpoints).
    pixels = dict(size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1, max_patches=4)
    config = InternVLConfig(
        text_config={**_text_config(tokenizer, hidden_size, layers), "model_type": "qwen2"},
        vision_config={**VISION, "image_size": [tile, tile], "patch_size": [PATCH, PATCH]},
        image_token_id=tokenizer.context_image_token_id, image_seq_length=4, downsample_ratio=0.5)
    processor = InternVLProcessor(image_processor=GotOcr2ImageProcessor(**pixels), tokenizer=tokenizer,
                                  video_processor=InternVLVideoProcessor(size={"height": tile, "width": tile}),
                                  image_seq_length=4)
    return config, processor


def _gemma3(hidden_size: int, layers: int):
    from tokenizers import AddedToken
    from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3Processor

    # vLLM's Gemma 3 processor merges the newlines around an image into Gemma's tokenizer's "\n\n\n" and
    # "\n\n\n\n" tokens: SmolLM2's tokenizer gets Gemma's newline tokens (Gemma 3's own tokenizer,
    # 262144 tokens, takes 3 s a load, which vLLM does several times an engine).
    tokenizer = _tokenizer({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                            "image_token": "<image_soft_token>"})
    tokenizer.add_tokens([AddedToken("\n" * n, normalized=False, special=False) for n in (1, 2, 3, 4)])
    side = 4 * PATCH   # 16 patches, pooled to 4 image tokens
    text = _text_config(tokenizer, hidden_size, layers, sliding_window=64, query_pre_attn_scalar=64,
                        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    # No pooling head on the SigLIP tower, as in Gemma 3's checkpoints (the model reads its patch features).
    config = Gemma3Config(text_config=text, vision_config={**VISION, "image_size": side, "patch_size": PATCH,
                                                           "vision_use_head": False},
                          mm_tokens_per_image=4, boi_token_index=tokenizer.boi_token_id,
                          eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": side, "width": side}),
                                tokenizer=tokenizer, image_seq_length=4)
    return config, processor


def _llava(family: str, hidden_size: int, layers: int):
    from transformers import (CLIPImageProcessor, LlavaConfig, LlavaOnevisionConfig, LlavaOnevisionImageProcessor,
                              LlavaOnevisionProcessor, LlavaProcessor)
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    tokenizer = _tokenizer(added=("<image>", "<video>"))
    image, video = tokenizer.convert_tokens_to_ids(["<image>", "<video>"])
    side = 4 * PATCH   # 16 patches, 16 image tokens (a CLIP tower's class token dropped)
    text = {**_text_config(tokenizer, hidden_size, layers), "model_type": "llama"}
    if family == "llava":
        config = LlavaConfig(text_config=text, vision_config={**VISION, "model_type": "clip_vision_model",
                                                              "image_size": side, "patch_size": PATCH, "projection_dim": 64},
                             image_token_index=image, image_seq_length=16, tie_word_embeddings=True)
        processor = LlavaProcessor(
            image_processor=CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
            tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
            num_additional_image_tokens=1)
        return config, processor
    # LLaVA-OneVision's "anyres": the image in a grid of up to 2 x 2 tiles of 56 pixels beside a
    # base view, its features unpadded to the image's aspect ratio with a newline token a row.
    grids = [[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
    config = LlavaOnevisionConfig(text_config=text, vision_config={**VISION, "model_type": "siglip_vision_model",
                                                                   "image_size": side, "patch_size": PATCH,
                                                                   "vision_use_head": False},
                                  image_token_index=image, video_token_index=video, image_grid_pinpoints=grids,
                                  tie_word_embeddings=True)
    pixels = dict(size={"height": side, "width": side}, image_grid_pinpoints=grids)
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(**pixels), tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size={"height": side, "width": side}),
        num_image_tokens=16, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")
    return config, processor


def _mistral3(hidden_size: int, layers: int):
    from transformers import Mistral3Config, PixtralImageProcessor, PixtralProcessor

    tokens = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
    tokenizer = _tokenizer(added=tokens)
    longest = 8 * PATCH   # Pixtral keeps the aspect ratio: up to 8 x 8 patches, 4 x 4 tokens after the merge
    config = Mistral3Config(text_config={**_text_config(tokenizer, hidden_size, layers), "model_type": "mistral"},
                            vision_config={**VISION, "head_dim": 32, "image_size": longest, "patch_size": PATCH},
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": longest}, patch_size=PATCH),
                                 tokenizer=tokenizer, patch_size=PATCH, spatial_merge_size=2)
    return config, processor


def tiny_config_and_processor(family: str, *, hidden_size: int = 128, layers: int = 2):
    """(the family's config, its processor with SmolLM2's tokenizer and chat template), unsaved."""
    if family not in FAMILIES:
        raise ValueError(f"unknown vision-language family {family!r}; one of {', '.join(FAMILIES)}")
    if family.startswith("qwen"):
        config, processor = _qwen_vl(family, hidden_size, layers)
    elif family.startswith("llava"):
        config, processor = _llava(family, hidden_size, layers)
    else:
        config, processor = {"internvl": _internvl, "gemma3": _gemma3, "mistral3": _mistral3}[family](hidden_size, layers)
    template = GEMMA_TEMPLATE if family == "gemma3" else CHAT_TEMPLATE
    processor.chat_template = template.replace("<image>", IMAGE_TEXT[family])
    return config, processor


# Families whose language model is Llama's with q/k/v biases (Qwen2's), so a Llama model's weights fit it.
TAKES_A_LLAMA = ("qwen2_vl", "qwen2_5_vl")


def tiny_vision_model(family: str, directory: Path, *, hidden_size: int = 128, layers: int = 2, seed: int = 0,
                      language_model: Path | None = None) -> Path:
    """A random vision-language model of `family` saved with its processor at `directory` (returned).
    language_model: a Llama-family causal LM directory (SmolLM2-135M-Instruct) whose shape and weights the
    language model takes (Qwen2-VL and Qwen2.5-VL: their q/k/v biases 0); the vision tower stays random."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config, processor = tiny_config_and_processor(family, hidden_size=hidden_size, layers=layers)
    trained = None
    if language_model is not None:
        if family not in TAKES_A_LLAMA:
            raise ValueError(f"language_model: {family}'s language model is not Llama's; one of {', '.join(TAKES_A_LLAMA)}")
        trained = AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
        config = _with_language_model(config, trained.config)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    if trained is not None:
        take_language_model(model.model.language_model, trained)
    model.config.architectures = [type(model).__name__]
    keep_checkpoint_names(model, None)   # the names of the family's checkpoints, which vLLM loads
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def _with_language_model(config, llama):
    """`config` with its language model in the shape of the Llama config `llama` (the M-RoPE sections
    kept: a head of 64 has 32 rotary pairs either way)."""
    text = config.text_config.to_dict()
    head_dim = getattr(llama, "head_dim", None) or llama.hidden_size // llama.num_attention_heads
    if head_dim != 64:
        raise ValueError(f"the language model's heads are {head_dim} wide; the tiny M-RoPE sections need 64")
    rope = {**text["rope_parameters"], "rope_theta": llama.rope_parameters["rope_theta"]}
    text.update(hidden_size=llama.hidden_size, intermediate_size=llama.intermediate_size,
                num_hidden_layers=llama.num_hidden_layers, num_attention_heads=llama.num_attention_heads,
                num_key_value_heads=llama.num_key_value_heads, head_dim=head_dim, rms_norm_eps=llama.rms_norm_eps,
                max_position_embeddings=llama.max_position_embeddings, rope_parameters=rope, layer_types=None)
    vision = config.vision_config.to_dict()
    vision["out_hidden_size" if "out_hidden_size" in vision else "hidden_size"] = llama.hidden_size
    fields = {k: getattr(config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                              "vision_end_token_id")}
    return type(config)(text_config=text, vision_config=vision, **fields)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m colo.bench.tiny_vision",
                                     description="Write a tiny random vision-language model of a family with its processor.")
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--language-model", metavar="DIR", help="take this Llama-family model's shape and weights for "
                        f"the language model ({', '.join(TAKES_A_LLAMA)}; e.g. SmolLM2-135M-Instruct: python -m colo.smollm2)")
    args = parser.parse_args(argv)
    print(tiny_vision_model(args.family, Path(args.directory), seed=args.seed, language_model=args.language_model))


if __name__ == "__main__":
    main()
