"""Tiny random vision-language models with a real tokenizer, built offline from transformers' config
classes: what the vision-language tests and the worked example (docs/vision.md) train.

Idefics3 (SmolVLM's architecture: a SigLIP vision tower, a pixel-shuffle projector, a Llama language
model) gets SmolLM2-135M-Instruct's tokenizer and chat format (colo.smollm2); 56x56
images of 14-pixel patches, 4 image tokens each. The other families' tiny models (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, InternVL, Gemma 3, LLaVA, LLaVA-OneVision, Mistral 3): colo.bench.tiny_vision.
"""
from __future__ import annotations

from pathlib import Path

# SmolLM2's chat format (ChatML), its image parts written as the processor's <image> placeholder.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

IMAGE_SIZE = 56   # pixels a side: 4 x 4 patches of 14, 4 image tokens after the 2x2 pixel shuffle


def tiny_idefics3(directory: Path, *, tokenizer_dir: Path | None = None, hidden_size: int = 128,
                  layers: int = 2, seed: int = 0, language_model: Path | None = None) -> Path:
    """A random Idefics3ForConditionalGeneration saved with its processor at `directory` (returned).
    language_model: a Llama-family causal LM directory (SmolLM2-135M-Instruct, as SmolVLM's) whose
    weights and shape the language model takes; the vision tower and projector stay random."""
    import torch
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from ..smollm2 import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or smollm2_dir())
    # SmolVLM's tokenizer has <global-img> as one token; written as text pieces, vLLM's processor does not
    # recognise a prompt the processor already expanded and expands its image again.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<global-img>"]})
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE_SIZE},
                                                max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False)
    # The processor adds its image tokens to the tokenizer.
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=CHAT_TEMPLATE)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=hidden_size // 64,
                num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad)
    trained = None
    if language_model is not None:
        from transformers import AutoModelForCausalLM

        trained = AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
        text = {**trained.config.to_dict(), "vocab_size": len(tokenizer), "tie_word_embeddings": True}
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=14)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=processor.image_token_id, tie_word_embeddings=True,
                            pad_token_id=pad)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    if trained is not None:
        take_language_model(model.model.text_model, trained)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def take_language_model(text_model, trained) -> None:
    """The weights of the Llama-family causal LM `trained` in a vision-language model's language model
    `text_model`: its vocabulary grows by the image tokens (their rows stay random), and q/k/v biases
    the Llama has not (Qwen2's) are 0; a ValueError where the rest does not fit."""
    import torch

    state = trained.model.state_dict()
    embed = state.pop("embed_tokens.weight")
    missing, unexpected = text_model.load_state_dict(state, strict=False)
    biases = [k for k in missing if k.endswith("_proj.bias")]
    others = [k for k in missing if k != "embed_tokens.weight" and k not in biases]
    if unexpected or others:
        raise ValueError(f"the language model's weights do not fit (unexpected {unexpected[:3]}, missing {others[:3]})")
    with torch.no_grad():
        text_model.embed_tokens.weight[:embed.shape[0]] = embed
        parameters = dict(text_model.named_parameters())
        for name in biases:
            parameters[name].zero_()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m colo.bench.vision_models",
                                     description="Write a tiny random Idefics3 (SmolLM2's tokenizer) with its processor.")
    parser.add_argument("directory")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--language-model", metavar="DIR", help="take this Llama-family model's weights for the "
                        "language model (e.g. SmolLM2-135M-Instruct: python -m colo.smollm2 DIR), as SmolVLM does")
    args = parser.parse_args(argv)
    print(tiny_idefics3(Path(args.directory), hidden_size=args.hidden_size, layers=args.layers, seed=args.seed,
                        language_model=args.language_model))


if __name__ == "__main__":
    main()
