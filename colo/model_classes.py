"""Which transformers class colo trains for a model's config: its causal LM, or, for a vision-language
model (a vision tower and a projector in front of a language model), its image-text-to-text class.
One place for the trainer's meta model (colo.shared), the sizes (colo.kv_sizing) and OUT/final
(colo.hf_format). No torch import."""
from __future__ import annotations


def is_vision_language(config) -> bool:
    """Whether transformers builds this config as an image-text-to-text model (a vision tower and a
    projector in front of a language model) rather than a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as image_text

    model_type = getattr(config, "model_type", None)
    return getattr(config, "vision_config", None) is not None or (model_type in image_text and model_type not in causal)


def trainer_class_name(config) -> str | None:
    """The transformers class colo trains for this config: its causal LM, or for a vision-language model
    its image-text-to-text class (None where transformers has neither)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as image_text

    model_type = getattr(config, "model_type", None)
    mapping = image_text if is_vision_language(config) else causal
    return mapping.get(model_type)


def trainer_auto_class(config):
    """transformers' Auto class that builds and loads the model colo trains for this config."""
    import transformers

    if is_vision_language(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM
