"""`python -m colo.grpo.export CKPT -o DIR`: the model of a colo.grpo checkpoint in Hugging Face format.

    python -m colo.grpo.export OUT -o DIR                   the newest checkpoint in a run's --out
    python -m colo.grpo.export OUT/step-000020.pt -o DIR --save-dtype bf16
    python -m colo.grpo.export OUT -o DIR --merge-lora      LoRA: the PEFT adapter and DIR/merged

What is written, and in which dtype, is colo.hf_format's (the same as a run's OUT/final).
Exit status: 0 written, 2 bad arguments or a file that is not a colo.grpo checkpoint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..hf_format import check_writable, master_weights, save_dtype, weights_to_save, write_adapter_dir, write_model


def export_checkpoint(checkpoint: str | Path, directory: str | Path, dtype: torch.dtype | None = None,
                      merge_lora: bool = False, model_dir: str | Path | None = None) -> Path:
    """Write the model of a colo.grpo checkpoint (step-N.pt) in Hugging Face format to `directory`.
    model_dir: the base model (default: the one the checkpoint names)."""
    from .checkpoint import is_sharded, load_checkpoint, load_optimizer_shards, tensor_parallel_size
    from .config import GRPOConfig

    checkpoint = Path(checkpoint)
    state = load_checkpoint(checkpoint)
    base = Path(model_dir or state.get("model_dir") or "")
    if not (base / "config.json").is_file():
        raise CheckpointError(f"{checkpoint} was trained from {base}, which is not a Hugging Face model directory "
                              "here; give it with --model")
    config = GRPOConfig.from_dict(state["config"])
    if config.lora_rank:
        return write_adapter_dir(state["model"], config.lora_spec, base, Path(directory), dtype, merge_lora)
    if merge_lora:
        raise ValueError(f"--merge-lora: {checkpoint} is a full fine-tuning checkpoint, not a LoRA one")
    optimizer = state["optimizer"]
    if is_sharded(state):
        optimizer = load_optimizer_shards(checkpoint, state, "rank" if tensor_parallel_size(state) == 1 else "tp0-rank")
    masters = None
    if tensor_parallel_size(state) == 1:
        names, shapes = _trainable_names(state, base)
        masters = master_weights(optimizer, names, shapes)
    return write_model(weights_to_save(state["model"], masters), base, Path(directory), dtype)


def _trainable_names(state: dict, base: Path) -> tuple[list[str], dict]:
    """The trainable parameters' names in the optimizer's order (the checkpoint's, or the model's own
    order for checkpoints that predate the list) and their shapes."""
    names = state.get("param_names")
    if names is None:
        from transformers import AutoConfig

        from ..model_classes import trainer_auto_class

        config = AutoConfig.from_pretrained(base)
        with torch.device("meta"):
            model = trainer_auto_class(config).from_config(config)
        names = [n for n, _ in model.named_parameters()]
    shapes = {n: state["model"][n].shape for n in names}
    return list(names), shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colo.grpo.export", description=(
        "Write the model of a colo.grpo checkpoint in Hugging Face format (full fine-tuning: a model directory "
        "with the base model's tokenizer; LoRA: a PEFT adapter)."))
    parser.add_argument("checkpoint", help="a checkpoint file (OUT/step-000020.pt) or a run's --out directory "
                        "(its newest checkpoint)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="the directory to write")
    parser.add_argument("--save-dtype", metavar="DTYPE", help="bf16, fp16 or fp32 (default: the base model's own)")
    parser.add_argument("--merge-lora", action="store_true", help="LoRA: also write DIR/merged, the base with the "
                        "adapter merged in")
    parser.add_argument("--model", metavar="DIR", help="the base model directory (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        dtype = save_dtype(args.save_dtype)
        path = Path(args.checkpoint)
        if path.is_dir():
            from .checkpoint import latest_checkpoint

            found = latest_checkpoint(path)
            if found is None:
                raise CheckpointError(f"{path} holds no checkpoint (step-*.pt)")
            path = found
        check_writable(Path(args.output).parent, "-o")
        written = export_checkpoint(path, args.output, dtype, args.merge_lora, args.model)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"colo.grpo.export: error: {e}", file=sys.stderr)
        return 2
    print(f"colo.grpo.export: {path} -> {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
