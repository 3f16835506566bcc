"""PEFT's adapter format: adapter_config.json and adapter_model.safetensors, tensors under PEFT's names
and in its units (B without the scaling). Written from colo's adapters (colo.lora) and its checkpoints
(colo.hf_format); `spec` is a colo.lora.LoraSpec (its `peft_config()` and `scaling`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .files import staged_directory

PEFT_PREFIX = "base_model.model."


def peft_adapter_state(full: dict[str, torch.Tensor], scaling) -> dict[str, torch.Tensor]:
    """A full_state_dict ({module}.lora_A / .lora_B, B in the slot's units: scaling x PEFT's) in PEFT's
    names and units; scaling: alpha / rank, or {module: its scaling}."""
    state = {}
    for key in sorted(full):
        if not key.endswith(".lora_A"):
            continue
        name = key[:-len(".lora_A")]
        a, b = full[key], full[f"{name}.lora_B"]
        scale = scaling[name] if isinstance(scaling, dict) else scaling
        state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().clone()
        state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (b.detach().float() / scale).to(b.dtype)
    return state


def write_adapter(directory, spec, state: dict[str, torch.Tensor], base_model: str = "") -> Path:
    """Write a PEFT-format adapter (adapter_config.json, adapter_model.safetensors) to `directory`,
    whole or not at all."""
    with staged_directory(directory) as staging:
        write_adapter_files(staging, spec, state, base_model)
    return Path(directory)


def write_adapter_files(directory: Path, spec, state: dict[str, torch.Tensor], base_model: str = "") -> None:
    """The two files of a PEFT-format adapter, into an existing directory."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(Path(directory) / "adapter_model.safetensors"))
    (Path(directory) / "adapter_config.json").write_text(json.dumps(spec.peft_config(base_model), indent=2))
