"""Tiny random vision-language models with a real tokenizer, built offline from transformers' config
classes: what the vision-language tests and the worked example (docs/vision.md) train.

Idefics3 (SmolVLM's architecture: a SigLIP vision tower, a pixel-shuffle projector, a Llama language
model) gets SmolLM2-135M-Instruct's tokenizer and chat format (colo.smollm2), as SmolVLM does; 56x56
images of 14-pixel patches, 4 image tokens each. The families whose vLLM or transformers image code
needs torchvision (Qwen2-VL, Qwen2.5-VL, InternVL, Gemma 3, SmolVLM: their processors or vLLM's model
modules import it) cannot be built or served on these CPU machines, where no torchvision works with
the CPU torch (docs/vision.md).
"""
from __future__ import annotations

from pathlib import Path

# SmolVLM's chat format over SmolLM2's tokenizer: "User:<image>text<end_of_utterance>\nAssistant:".
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")

IMAGE_SIZE = 56   # pixels a side: 4 x 4 patches of 14, 4 image tokens after the 2x2 pixel shuffle


def tiny_idefics3(directory: Path, *, tokenizer_dir: Path | None = None, hidden_size: int = 128,
                  layers: int = 2, seed: int = 0) -> Path:
    """A random Idefics3ForConditionalGeneration saved with its processor at `directory` (returned)."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from ..smollm2 import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or smollm2_dir())
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE_SIZE},
                                                max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False)
    # The processor adds its image tokens to the tokenizer.
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=IDEFICS3_CHAT_TEMPLATE)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=hidden_size // 64,
                num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=14)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=processor.image_token_id, tie_word_embeddings=True,
                            pad_token_id=tokenizer.pad_token_id)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    model.generation_config.save_pretrained(directory)
    return directory
