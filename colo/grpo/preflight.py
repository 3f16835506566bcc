"""What a run is checked against once, before any engine starts: the model directory (colo trains it,
and `tensor_parallel` ranks can split it), the output directory (writable) and, for a resumed run,
the checkpoint it continues from (there, and readable).

GRPOScheduler makes these checks itself (check_run) unless it is handed their result, a CheckedRun:
`python -m colo.grpo` makes them first, each failure a usage error naming its flag, and passes the
CheckedRun on, so nothing is checked, and no checkpoint read, twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..hf_format import check_writable
from ..hub import resolve_model
from .checkpoint import checkpoint_to_resume
from .config import GRPOConfig, check_model_dir


@dataclass(frozen=True)
class CheckedRun:
    """A run's checked inputs: model_dir (a hub id resolved to its local snapshot), out_dir (None: no
    checkpoints) and resume_from, the newest checkpoint's (path, contents) for a resumed run (None: a
    new run)."""
    model_dir: Path
    out_dir: Path | None
    resume_from: tuple[Path, dict] | None = None


def check_run(model_dir, config: GRPOConfig, *, out_dir=None, resume: bool = False) -> CheckedRun:
    """Refuse what the run cannot do before anything is built: the model (check_model_dir's errors),
    an output directory that cannot be written (ValueError), resume without a readable checkpoint in
    out_dir (ValueError, colo.errors.CheckpointError)."""
    model_dir = resolve_model(model_dir)
    check_model_dir(model_dir, config.tensor_parallel, config.lora_spec)
    out_dir = Path(out_dir) if out_dir is not None else None
    if out_dir is not None:
        check_writable(out_dir, "out_dir")
    return CheckedRun(model_dir, out_dir, checkpoint_to_resume(out_dir) if resume else None)
