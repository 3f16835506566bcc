"""Which transformers class colo trains for a model's config: its causal LM, or, for a vision-language
model (a vision tower and a projector in front of a language model), its image-text-to-text class.
One place for the trainer's meta model (colo.shared), the sizes (colo.kv_sizing) and OUT/final
(colo.hf_format); which of a model's buffers it saves with its weights, and its dropout switched off. No
torch import at module level."""
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


# Where transformers' vision-language models keep their vision tower (under the base model), and the
# name of a projector kept inside it (Qwen2-VL's `visual.merger`), which trains with the language model.
VISION_TOWERS = ("vision_tower", "vision_model", "visual")
PROJECTORS_IN_TOWER = ("merger",)
# transformers' names of the projector between the vision tower and the language model.
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mlp1", "visual_projection")


def vision_tower_parameters(model) -> list:
    """The parameters of a vision-language model's vision tower, its projector not included (none for a
    text model); a ValueError where a vision-language model has none of the known tower names."""
    if not is_vision_language(model.config):
        return []
    for holder in (model.base_model, model):
        for name in VISION_TOWERS:
            tower = getattr(holder, name, None)
            if tower is not None:
                return [p for n, p in tower.named_parameters()
                        if not any(part in PROJECTORS_IN_TOWER for part in n.split("."))]
    raise ValueError(f"{type(model).__name__}: no vision tower under the names {', '.join(VISION_TOWERS)}; "
                     "train it with the rest (train_vision=True)")


def persistent_buffers(hf_model) -> dict:
    """{name: buffer} of the buffers `hf_model` saves with its weights (a DeepSeek-V3 or GLM-4.5 router's
    `e_score_correction_bias`), which vLLM loads as weights; not rotary tables and other computed ones."""
    saved = set(hf_model.state_dict(keep_vars=True))
    return {name: buffer for name, buffer in hf_model.named_buffers() if name in saved}


def disable_dropout(model) -> None:
    """Every dropout probability of a transformers model 0 (TRL's `disable_dropout`, which sets each
    torch.nn.Dropout's): also the attention modules' `attention_dropout`, which transformers 5 passes to
    the attention function itself rather than through a Dropout layer."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
