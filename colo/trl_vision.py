"""Image prompts in colo.trl: the engine gets each prompt as the chat template wrote it, and expands its
images itself.

TRL tokenizes an image prompt with the model's processor, which expands every image placeholder into the
image's tokens, and sends those ids with the images to vLLM. vLLM (0.32) expands the placeholders of a
token prompt again, so the engine would generate from another prompt than the one the trainer trains on
(on the tiny Idefics3, a 20-token prompt became 26 tokens, and the sampled tokens' log-probabilities
differed from the trainer's by up to 0.2 before any update). colo.trl sends the engine the template's
ids before expansion (the tokenizer's, not the processor's) and checks that the engine's expansion is
the trainer's prompt, token for token.
"""
from __future__ import annotations


def unexpanded_prompt_ids(processing_class, prompts: list, *, tools_per_prompt: list, chat_template,
                          chat_template_kwargs: dict) -> list[list[int]]:
    """The token ids of each conversational prompt as its chat template writes it (one placeholder per
    image), rendered as TRL's _tokenize_prompts renders it, tokenized without the processor."""
    from trl.data_utils import prepare_multimodal_messages

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    ids = []
    for prompt, tools in zip(prompts, tools_per_prompt, strict=True):
        text = processing_class.apply_chat_template(
            conversation=[prepare_multimodal_messages(prompt)], tools=tools or None, chat_template=chat_template,
            add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
        text = text[0] if isinstance(text, list) else text
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


class EnginePrompts:
    """The unexpanded ids the engine gets for each expanded prompt of the current generation round.

    A later turn of TRL's tool loop sends an earlier prompt followed by its completion and the tool's
    reply: the prompt's expanded ids are then a prefix, replaced by its unexpanded ids."""

    def __init__(self):
        self.by_expanded: dict[tuple[int, ...], list[int]] = {}

    def add(self, expanded: list[list[int]], unexpanded: list[list[int]]) -> None:
        for long, short in zip(expanded, unexpanded, strict=True):
            self.by_expanded[tuple(long)] = list(short)

    def clear(self) -> None:
        self.by_expanded.clear()

    def for_engine(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key in self.by_expanded:
            return self.by_expanded[key]
        for expanded, short in self.by_expanded.items():
            if key[:len(expanded)] == expanded:
                return short + list(prompt[len(expanded):])
        return list(prompt)

    @staticmethod
    def check(trained: list[list[int]], served: list[list[int]], images: list) -> None:
        """The engine's prompt (after its expansion of the images) must be the trainer's, row by row."""
        for row, (ours, theirs, row_images) in enumerate(zip(trained, served, images, strict=True)):
            if row_images and list(ours) != list(theirs):
                raise ValueError(
                    f"colo.trl: prompt {row} ({len(row_images)} image(s)): the engine expanded its images into "
                    f"{len(theirs)} prompt tokens, the processor into {len(ours)}; the engine would generate "
                    "from another prompt than the one trained on. The chat template's image placeholder and "
                    "vLLM's for this model must agree (its processor files, e.g. image_seq_len, as vLLM reads them)")


def attend_images_as_the_engine(llm, models: list) -> bool:
    """Where the engine attends causally among an image's tokens and transformers both ways (Gemma 3 on
    vLLM's CPU backend: colo.vllm_compat.image_attention_is_causal), every forward of `models` (the
    policy, TRL's reference model) gets its both-ways fields (token_type_ids) as all text, so TRL trains
    on the attention the engine sampled with, as colo.grpo does. Returns whether it did."""
    import logging

    from .grpo.images import attending_causally
    from .vllm_compat import image_attention_is_causal

    if not image_attention_is_causal(llm):
        return False

    def causal(module, args, kwargs):
        return args, attending_causally(kwargs)

    for model in models:
        model.register_forward_pre_hook(causal, with_kwargs=True)
    logging.getLogger("colo.trl").warning(
        "colo.trl: this engine attends causally among an image's tokens, where transformers attends both ways "
        "(vLLM's backend here has no bidirectional image attention); the trainer's forwards attend as the "
        "engine does, so training is on-policy, and the saved model attends both ways again where it is served")
    return True
