"""The weight names a saved model directory is written with: those of the checkpoint it was made from.

transformers 5 renames a checkpoint's weights as it loads them (its conversion mapping: LLaVA's CLIP
tower is `vision_tower.vision_model.*` in llava-hf's checkpoints, `vision_tower.*` in the model) and
`save_pretrained` renames them back, but only with the renamings `from_pretrained` used. A model built
from its config, as colo builds the trainer's and OUT/final's (the weights are the engine's), has used
none, and transformers then drops the prefix changes: it saves LLaVA's tower as `vision_tower.embeddings.*`,
which vLLM 0.32's LLaVA does not load ("no module or parameter named 'vision_tower.embeddings'").
`keep_checkpoint_names` gives such a model the renamings loading the checkpoint would have used.

Reads transformers' conversion mapping (transformers.conversion_mapping, core_model_loading; 5.x) and
sets the `_weight_conversions` attribute `from_pretrained` sets; checked by
tests/sharing/test_vision_engine_families.py (OUT/final of each family loads in vLLM).
"""
from __future__ import annotations

import json
from pathlib import Path


def safetensors_files(model_dir: Path) -> list[Path]:
    """A model directory's weight files: those its index names, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(model_dir.glob("*.safetensors"))


def checkpoint_keys(model_dir: Path) -> list[str]:
    """The weight names in a model directory's safetensors files (their headers only)."""
    from safetensors import safe_open

    keys = []
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as weights:
            keys.extend(weights.keys())
    return keys


def keep_checkpoint_names(model, keys: list[str] | None) -> None:
    """Make `model.save_pretrained` write the names of a checkpoint holding `keys` (the renamings
    transformers' loading of those keys uses); keys=None: every renaming of the model's family, prefix
    changes included (the names of the family's checkpoints on the Hub, for a model made from scratch)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model, add_legacy=keys is not None)
    if keys is not None:
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        for key in keys:
            rename_source_key(key, renamings, converters)
        conversions = [c for c in conversions if c.was_used()]
    model._weight_conversions = conversions


def read_checkpoint_tensors(model_dir: Path, names: list[str]) -> dict:
    """{name: tensor} of the named weights of a model directory's safetensors files, only those read."""
    from safetensors import safe_open

    wanted, found = set(names), {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as weights:
            for name in wanted & set(weights.keys()):
                found[name] = weights.get_tensor(name)
    return found
