"""The trained model in Hugging Face format: what a run leaves for transformers, vLLM, PEFT and the Hub.

    OUT/final/              written at the end of every colo.grpo run (Checkpointer.save_model)
    OUT/model-step-N/       every N steps with --save-model-every N
    python -m colo.grpo.export OUT/step-000020.pt -o DIR     the same from a checkpoint (export.py)

Full fine-tuning writes a model directory with save_pretrained (safetensors, config.json) plus the
base model's tokenizer, chat template and generation config, in `dtype` (default: the base model's
own, config.json's `dtype`). Where the run kept fp32 master weights (bf16 training), those are what
is saved, rounded to `dtype`: the bf16 weights the engine served are the same masters rounded to
bf16, so a bf16 save equals them, while an fp32 save keeps what that rounding dropped. With tensor
parallelism the whole weights are gathered on rank 0 and saved as the engine served them (the
masters stay sharded per tensor-parallel rank).

LoRA writes the adapter in PEFT's format (adapter_config.json, adapter_model.safetensors) with the
tokenizer, and with merge_lora also `merged/`: the base with W + alpha/r * B @ A in every adapted layer,
computed in fp32 from the base model's own weights.

A directory is written beside its name and renamed into place, so a name never holds half a model,
and a failed save leaves the checkpoints (and an earlier directory of that name) as they were.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .dtype_choice import BY_NAME
from .errors import CheckpointError
from .files import staged_directory
from .hf_names import checkpoint_keys, keep_checkpoint_names
from .model_classes import trainer_auto_class
from .peft_format import peft_adapter_state, write_adapter_files

FINAL = "final"


def save_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a --save-dtype name stands for (None: the base model's own)."""
    if name is None:
        return None
    try:
        return BY_NAME[str(name).lower()]
    except KeyError:
        raise ValueError(f"--save-dtype: {name!r} is not a dtype colo saves in; one of bf16, fp16, fp32") from None


def model_step_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"model-step-{step}"


def base_dtype(model_dir: Path) -> torch.dtype:
    """The dtype config.json names (`dtype`, or `torch_dtype` before transformers 5); fp32 if none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return BY_NAME.get(str(name).replace("torch.", ""), torch.float32)


# -- what is saved ---------------------------------------------------------------------------------
def master_weights(optimizer_state, names: list[str], shapes: dict[str, torch.Size]) -> dict | None:
    """{name: fp32 master} from an optimizer's state: a colo.MasterWeightOptimizer's (one flat tensor in
    the order of `names`, the trainable parameters) or every rank's colo.ShardedMasterWeightOptimizer
    shard (reassembled); None where the state holds no masters (fp32 training: the weights are them)."""
    numels = [shapes[n].numel() for n in names]
    total = sum(numels)
    if isinstance(optimizer_state, dict) and isinstance(optimizer_state.get("master_weights"), torch.Tensor):
        flat = optimizer_state["master_weights"]
    elif isinstance(optimizer_state, (list, tuple)) and optimizer_state and \
            all(isinstance(s, dict) and "ranges" in s for s in optimizer_state):
        flat = torch.full((total,), float("nan"), dtype=torch.float32)
        for shard in optimizer_state:  # each shard: pieces [begin, end) of the concatenated parameters
            offset = 0
            for begin, end in shard["ranges"].tolist():
                flat[begin:end] = shard["master_weights"][offset:offset + end - begin]
                offset += end - begin
        if torch.isnan(flat).any():
            raise CheckpointError("the optimizer shards do not cover every master weight; pass every rank's shard")
    else:
        return None
    if flat.numel() != total:
        raise CheckpointError(f"the optimizer state holds {flat.numel()} master weights, the model's trainable "
                              f"parameters {total}: not this model's optimizer")
    out, offset = {}, 0
    for name, numel in zip(names, numels):
        out[name] = flat[offset:offset + numel].view(shapes[name])
        offset += numel
    return out


def weights_to_save(model_state: dict, masters: dict | None) -> dict:
    """The model's state with each trainable weight replaced by its fp32 master where there is one (a
    tied head has none of its own: write_model ties it to the embedding's)."""
    return {**model_state, **(masters or {})}


# -- writing ---------------------------------------------------------------------------------------
def write_model(state: dict, base_dir: Path, directory: Path, dtype: torch.dtype | None = None) -> Path:
    """A Hugging Face model directory of `state` (full weights, Hugging Face names) in `dtype`, with the
    config, tokenizer, chat template and generation config of `base_dir`."""
    from transformers import AutoConfig

    from .vllm_compat.trainer_models import building_trainer_models

    dtype = dtype or base_dtype(base_dir)
    config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"), building_trainer_models():  # no second initialised copy: the state is assigned in
        model = trainer_auto_class(config).from_config(config, dtype=dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.detach().to("cpu", dtype) for k, v in state.items() if not (tied and k == "lm_head.weight")}
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the weights do not fit the model at {base_dir}: missing {missing[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]}")
    if tied:
        model.tie_weights()
    model.config.dtype = dtype
    keys = checkpoint_keys(base_dir)
    if keys:   # the base checkpoint's names, which vLLM loaded (colo.hf_names)
        keep_checkpoint_names(model, keys)
    with staged_directory(directory) as staging:
        model.save_pretrained(staging)
        _copy_generation_and_tokenizer(base_dir, staging)
    return directory


def write_adapter_dir(adapter_state: dict, spec, base_dir: Path, directory: Path, dtype: torch.dtype | None = None,
                      merge: bool = False) -> Path:
    """A PEFT adapter directory from a colo adapter's full_state_dict ({module}.lora_A / .lora_B, B in
    the slot's units), with the tokenizer; merge: also `merged/`, the base with the adapter merged."""
    dtype = dtype or base_dtype(base_dir)
    peft = {k: v.to(dtype) for k, v in peft_adapter_state(adapter_state, spec.scaling).items()}
    with staged_directory(directory) as staging:
        write_adapter_files(staging, spec, peft, base_model=str(base_dir))
        _copy_generation_and_tokenizer(base_dir, staging, generation=False)
        if merge:
            write_model(merged_lora_state(base_dir, adapter_state, spec), base_dir, staging / "merged", dtype)
    return directory


def merged_lora_state(base_dir: Path, adapter_state: dict, spec) -> dict:
    """The base model's weights (fp32) with W += alpha/r * B @ A for every adapted layer."""
    from transformers import AutoConfig

    from .vllm_compat.trainer_models import building_trainer_models

    with building_trainer_models():
        auto = trainer_auto_class(AutoConfig.from_pretrained(base_dir))
        state = auto.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    for name in sorted(n[:-len(".lora_A")] for n in adapter_state if n.endswith(".lora_A")):
        a = adapter_state[f"{name}.lora_A"].float()
        b = adapter_state[f"{name}.lora_B"].float()  # already scale x PEFT's B (the slot's units)
        key = f"{name}.weight"
        if key not in state:
            raise CheckpointError(f"the adapter adapts {name}, which the model at {base_dir} does not have")
        state[key].add_(b @ a)
    return state


def _copy_generation_and_tokenizer(base_dir: Path, directory: Path, generation: bool = True) -> None:
    """The base model's generation config and tokenizer files (a model without a tokenizer, such as the
    toy, has none to copy)."""
    base_dir = Path(base_dir)
    if generation and (base_dir / "generation_config.json").is_file():
        shutil.copyfile(base_dir / "generation_config.json", directory / "generation_config.json")
    if _has_processor(base_dir):  # a vision-language model's: its image processor and tokenizer
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(base_dir).save_pretrained(directory)
    elif _has_tokenizer(base_dir):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(base_dir).save_pretrained(directory)


def _has_processor(model_dir: Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))


def _has_tokenizer(model_dir: Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def check_writable(directory: Path, flag: str = "--out") -> None:
    """Refuse an output directory that cannot be created or written, before anything is trained;
    creates nothing (a refused command leaves no directory behind)."""
    directory = Path(directory).absolute()
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {directory}: cannot write there ({existing} is a file)")
    if existing != directory:
        # (tried, not os.access: root passes os.access where nothing can be created, as under /proc)
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".colo-write-test-", dir=existing))
        except OSError as e:
            raise ValueError(f"{flag} {directory}: cannot write there ({existing}: {e.strerror or e})") from None
        return
    probe = directory / f".colo-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag} {directory}: cannot write there ({e.strerror or e})") from None
