"""Checkpoints of a GRPO run: written atomically, found again by step number, loaded with clear errors.

A checkpoint is one file `step-000012.pt` holding everything a resumed run needs to continue at
step 13 as if it had never stopped: model weights, optimizer state, learning-rate scheduler state,
every rank's RNG state, the step and the run's config. It is written to a temporary name, flushed
to disk and renamed, so a file with the final name is always complete; a run killed mid-write leaves
only a `.tmp` file that the next save removes.

With the optimizer state sharded over ranks (ZeRO-1), each rank first writes its shard the same way,
`step-000012.optimizer-rank1-of-4.pt`, and only then does rank 0 write `step-000012.pt` (whose
"optimizer" entry names the shards): a checkpoint that can be found is one whose shards are complete.
With tensor parallelism the model entry still holds the whole weights (Hugging Face names and
shapes, gathered when saving), and each tensor-parallel rank's optimizer state (its shards' masters
and moments) is a file of its own, `step-000012.optimizer-tp1-of-2.pt`, written the same way.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch

from ..errors import CheckpointError  # noqa: F401 - raised here, re-exported

FORMAT = "colo.grpo.checkpoint/1"
_NAME = re.compile(r"^step-(\d{6,})\.pt$")
_SHARD_NAME = re.compile(r"^step-(\d{6,})\.optimizer-(tp\d+-)?(rank|tp)\d+-of-\d+\.pt$")


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / f"step-{step:06d}.pt"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in out_dir, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for path in out_dir.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


def optimizer_shard_path(out_dir: str | Path, step: int, rank: int, world_size: int, kind: str = "rank") -> Path:
    """kind: "rank" for a ZeRO-1 shard, "tp" for a tensor-parallel rank's optimizer state, "tp{t}-rank"
    for a ZeRO-1 shard of tensor-parallel rank t's."""
    return Path(out_dir) / f"step-{step:06d}.optimizer-{kind}{rank}-of-{world_size}.pt"


def save_checkpoint(out_dir: str | Path, step: int, state: dict, keep: int = 2) -> Path:
    """Atomically write `state` as the checkpoint of `step`; keep only the newest `keep` checkpoints
    (with their optimizer shards; shards of steps that never got their checkpoint go too)."""
    out_dir = Path(out_dir)
    final = checkpoint_path(out_dir, step)
    for stale in out_dir.glob("step-*.pt.tmp"):  # only rank 0 writes now: the shards are all renamed
        stale.unlink(missing_ok=True)
    _write_atomically(final, {"format": FORMAT, "step": step, **state})
    found = list_checkpoints(out_dir)
    stale = found[:-keep] if keep > 0 else []
    for _, old in stale:
        old.unlink(missing_ok=True)
    kept = {s for s, _ in found[len(stale):]}
    for path in out_dir.iterdir():
        match = _SHARD_NAME.match(path.name)
        if match and int(match.group(1)) not in kept:
            path.unlink(missing_ok=True)
    return final


def save_optimizer_shard(out_dir: str | Path, step: int, rank: int, world_size: int, state: dict,
                         kind: str = "rank") -> Path:
    """Atomically write this rank's optimizer shard of `step` (before rank 0 writes the checkpoint)."""
    path = optimizer_shard_path(out_dir, step, rank, world_size, kind)
    _write_atomically(path, {"format": FORMAT, "step": step, "optimizer": state})
    return path


def load_optimizer_shards(checkpoint: str | Path, state: dict, kind: str = "rank") -> list[dict]:
    """The optimizer shards a sharded checkpoint names, every rank's, in rank order (kind: as
    optimizer_shard_path's; with tensor parallelism, those of one tensor-parallel rank)."""
    checkpoint = Path(checkpoint)
    world_size = int(state["optimizer"]["sharded_over"])
    shards = []
    for rank in range(world_size):
        path = optimizer_shard_path(checkpoint.parent, int(state["step"]), rank, world_size, kind)
        if not path.is_file():
            raise CheckpointError(f"{checkpoint} holds optimizer state sharded over {world_size} ranks, but {path} "
                                  "is missing")
        try:  # mmap: a rank reads only the pages of the shards that overlap its own
            shards.append(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["optimizer"])
        except Exception as e:  # noqa: BLE001 - torch raises many types for a truncated or foreign file
            raise CheckpointError(f"cannot read optimizer shard {path}: {type(e).__name__}: {e}") from e
    return shards


def tensor_parallel_size(state: dict) -> int:
    """The tensor-parallel size of the run that wrote this checkpoint (1: none)."""
    return int(state.get("config", {}).get("tensor_parallel", 1))


def load_tensor_parallel_optimizer(checkpoint: str | Path, state: dict, tp_rank: int) -> dict:
    """The optimizer state of tensor-parallel rank `tp_rank` that a checkpoint names."""
    checkpoint = Path(checkpoint)
    size = tensor_parallel_size(state)
    path = optimizer_shard_path(checkpoint.parent, int(state["step"]), tp_rank, size, "tp")
    if not path.is_file():
        raise CheckpointError(f"{checkpoint} holds the optimizer state of {size} tensor-parallel ranks, but {path} "
                              "is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["optimizer"]
    except Exception as e:  # noqa: BLE001 - torch raises many types for a truncated or foreign file
        raise CheckpointError(f"cannot read optimizer state {path}: {type(e).__name__}: {e}") from e


def is_sharded(state: dict) -> bool:
    return isinstance(state.get("optimizer"), dict) and "sharded_over" in state["optimizer"]


def _write_atomically(final: Path, obj) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(final.name + ".tmp")
    with open(temporary, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, final)
    _fsync_directory(final.parent)


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint written by save_checkpoint; CheckpointError names the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        # weights_only: a checkpoint is data; never run code from a file found on disk.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a truncated or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a colo GRPO checkpoint (expected format {FORMAT!r})")
    missing = [k for k in ("step", "model", "optimizer", "rng", "config") if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}")
    return state


def capture_rng() -> dict:
    """This process's random state: Python, torch CPU, torch CUDA (if initialised), numpy (if imported)."""
    python_state = random.getstate()
    state = {"python": [python_state[0], list(python_state[1]), python_state[2]], "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy_if_imported()
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    return state


def restore_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = _numpy_if_imported()
    if "numpy" in state and numpy is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _numpy_if_imported():
    import sys

    return sys.modules.get("numpy")


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry itself reaches the disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
