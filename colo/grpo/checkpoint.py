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

The functions read and write those files. A run's checkpoint policy is the Checkpointer at the end:
which checkpoint a resumed run continues from and whether it fits the run (checkpoint_to_resume,
read once by colo.grpo.preflight, then the optimizer layout, LoRA rank and tensor-parallel size),
restoring it into the live model the engine shares, and what each save holds and which rank writes
it. The scheduler decides when to save.
"""
from __future__ import annotations

import copy
import logging
import os
import random
import re
from pathlib import Path

import torch

from ..errors import CheckpointError, ModelSaveError  # noqa: F401 - raised here, re-exported
from . import distributed
from .. import hf_format

logger = logging.getLogger(__name__)

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


def checkpoint_to_resume(out_dir: str | Path | None, lead: str = "nothing to resume: ") -> tuple[Path, dict]:
    """The newest checkpoint in out_dir and its contents: what a resumed run continues from, read once
    before any engine starts (colo.grpo.preflight). Refuses a missing out_dir (ValueError), an out_dir
    without a checkpoint (CheckpointError, its message led by `lead`: the CLI leads every resume error
    with its flag instead) and an unreadable checkpoint (CheckpointError)."""
    if out_dir is None:
        raise ValueError("resume=True needs out_dir (the directory holding the checkpoints)")
    path = latest_checkpoint(out_dir)
    if path is None:
        raise CheckpointError(f"{lead}no checkpoint (step-*.pt) in {out_dir}")
    return path, load_checkpoint(path)


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
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path} is not a colo GRPO checkpoint (step-N.pt), or is damaged: torch.load "
                              f"failed with {type(e).__name__}: {first_line[:120]}") from e
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


class Checkpointer:
    """The checkpoints of one GRPO run: restore the one a resumed run continues from, save the
    finished steps. Every rank holds one and calls it at the same points (saving is collective).
    Rank 0 writes the checkpoint file, after the optimizer files it names: every rank's shard with
    ZeRO-1, each tensor-parallel rank's state with tensor parallelism.

    Built from the run's parts: its out_dir (None: save writes nothing), resolved config, world and
    model_dir (recorded in each checkpoint); the views the trainer trains (colo.shared's contract:
    whole weights, tensor-parallel shards or an adapter, whose full_state_dict is the checkpoint's
    model, and which publish restored weights); the memory phases (colo.grpo.phases, which bring the
    optimizer state within reach between steps); the training memory, optimizer and lr_scheduler; the KL reference (a frozen
    copy is checkpointed, an adapter's shared base is not); and the timeline that spans each write.
    """

    def __init__(self, out_dir: Path | None, config, world: distributed.World, model_dir: Path, *, views, phases,
                 memory, optimizer, lr_scheduler, reference, timeline):
        self.out_dir, self.config, self.world, self.model_dir = out_dir, config, world, model_dir
        self.views, self.phases = views, phases
        self.memory, self.optimizer, self.lr_scheduler = memory, optimizer, lr_scheduler
        self.reference, self.timeline = reference, timeline
        self.last_saved_step: int | None = None  # a step already on disk is not written again

    # -- resuming ----------------------------------------------------------------------------------
    @staticmethod
    def resume_state(checkpoint: tuple[Path, dict], config, world: distributed.World) -> dict:
        """The state of the checkpoint a run resumes from (checkpoint_to_resume's (path, contents)),
        checked against this run's config and with this rank's optimizer state in place; called before
        any engine starts, so a mismatch fails in seconds."""
        path, state = checkpoint
        if is_sharded(state) != config.shard_optimizer:
            raise CheckpointError(f"{path} holds {'sharded' if is_sharded(state) else 'unsharded'} optimizer state; "
                                  f"resume it with shard_optimizer={is_sharded(state)}")
        saved_rank = int(state.get("config", {}).get("lora_rank", 0))
        if saved_rank != config.lora_rank:
            raise CheckpointError(f"{path} was trained with lora_rank={saved_rank}; resume it with the same lora_rank "
                                  f"(this run has {config.lora_rank})")
        saved_tp = tensor_parallel_size(state)
        if saved_tp != config.tensor_parallel:
            raise CheckpointError(f"{path} was trained with tensor_parallel={saved_tp}; this run has "
                                  f"tensor_parallel={config.tensor_parallel}, and colo does not re-slice the "
                                  f"optimizer state between tensor-parallel sizes: resume with tensor_parallel={saved_tp}")
        if is_sharded(state):  # any number of (data-parallel) ranks: re-sharded on load
            state["optimizer"] = load_optimizer_shards(path, state, Checkpointer._shard_kind(world))
        elif saved_tp > 1:  # this rank's shards' optimizer state; any number of data-parallel ranks
            state["optimizer"] = load_tensor_parallel_optimizer(path, state, world.tp_rank)
        return state

    def restore(self, state: dict) -> int:
        """Load a checkpoint into the live, weight-sharing model, then let the engine see it; returns
        the checkpoint's step (already saved, so not written again)."""
        try:  # the whole weights (or adapter); with tensor parallelism this rank's shards of them
            self.views.load_full_state_dict(state["model"])
        except ValueError as e:
            raise CheckpointError(f"checkpoint does not fit the model at {self.model_dir}: {e}") from e
        with self.phases.optimizer_state_in_reach():  # bf16: the masters it restores live in the optimizer region
            self.optimizer.load_state_dict(state["optimizer"])
            self.memory.adopt_optimizer_state(self.optimizer)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.reference is not None and "reference" in state:
            self.reference.load_state_dict(state["reference"])
        # Generation is seeded per prompt, not by these; with another number of ranks, a rank the old
        # run did not have keeps its fresh seed.
        if self.world.rank < len(state["rng"]):
            restore_rng(state["rng"][self.world.rank])
        if len(state["rng"]) != self.world.size:
            logger.info("resuming a run of %d ranks on %d", len(state["rng"]), self.world.size)
        self.last_saved_step = int(state["step"])
        self.views.publish()
        return self.last_saved_step

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int) -> Path | None:
        """Write the checkpoint of `step`, the last finished one (all ranks call it; rank 0 writes).
        None, writing nothing, without an out_dir, before the first step or when `step` is saved."""
        if self.out_dir is None or step == self.last_saved_step or step == 0:
            return None
        rng = distributed.gather_objects(capture_rng(), self.world)
        self._check_ranks_agree(step)
        path = None
        if self.memory.shard is not None:  # every rank's shard is on disk before the checkpoint names them
            save_optimizer_shard(self.out_dir, step, self.world.dp_rank, self.world.dp_size,
                                 self._optimizer_state(), self._shard_kind(self.world))
            distributed.barrier(self.world)
        model_state = self.views.full_state_dict()  # with tensor parallelism a collective: every rank takes part
        if self.world.tp_size > 1 and self.memory.shard is None:  # each TP rank's optimizer state, once
            if self.world.dp_rank == 0:
                save_optimizer_shard(self.out_dir, step, self.world.tp_rank, self.world.tp_size,
                                     self._optimizer_state(), kind="tp")
            distributed.barrier(self.world)
        if self.world.is_main:
            with self.timeline.span("checkpoint", step=step):
                optimizer = {"sharded_over": self.world.dp_size} if self.memory.shard is not None else \
                    {} if self.world.tp_size > 1 else self._optimizer_state()
                if self.world.tp_size > 1:
                    optimizer["tensor_parallel_over"] = self.world.tp_size
                state = {"model": model_state, "optimizer": optimizer,
                         "lr_scheduler": self.lr_scheduler.state_dict(), "rng": rng,
                         "config": self.config.to_dict(), "model_dir": str(self.model_dir)}
                reference = self.reference.state_dict() if self.reference is not None else None
                if reference is not None:  # a frozen copy (an adapter's base is the model's own)
                    state["reference"] = reference
                if self.views.master_names() is not None:  # the masters' order, for colo.grpo.export
                    state["param_names"] = self.views.master_names()
                path = save_checkpoint(self.out_dir, step, state, keep=self.config.keep_checkpoints)
                self.views.save_beside_checkpoint(self.out_dir, base_model=str(self.model_dir), full=model_state)
        distributed.barrier(self.world)
        self.last_saved_step = step
        return path

    def save_model(self, directory: Path) -> Path | None:
        """The model as trained so far, in Hugging Face format (colo.hf_format): every rank calls it
        (gathering is collective) and rank 0 writes; the path on rank 0. A failure raises
        ModelSaveError on every rank, with the checkpoints untouched."""
        model_state = self.views.full_state_dict()  # with tensor parallelism a collective
        masters = self._masters()  # with ZeRO-1 a collective
        error = None
        if self.world.is_main:
            dtype = hf_format.save_dtype(self.config.save_dtype)
            try:
                with self.timeline.span("save_model"):
                    names = self.views.master_names()
                    found = hf_format.master_weights(masters, names, {n: model_state[n].shape for n in names}) \
                        if masters is not None else None
                    self.views.write_pretrained(directory, model_state, base_dir=self.model_dir, dtype=dtype,
                                                masters=found, merge=self.config.merge_lora)
            except (OSError, ValueError, RuntimeError) as e:
                error = f"{type(e).__name__}: {e}"
        if distributed.sum_floats([1.0 if error else 0.0], self.world)[0]:
            raise ModelSaveError(f"writing the model to {directory} failed ({error or 'on rank 0'}); the checkpoints "
                                 f"in {self.out_dir} are intact: python -m colo.grpo.export {self.out_dir} -o DIR")
        return Path(directory) if self.world.is_main else None

    def _masters(self):
        """What colo.hf_format.master_weights reads, on rank 0: the fp32 masters (every rank's shard
        with ZeRO-1, gathered); None where there are none (fp32 training), where the views' masters are
        not whole tensors (tensor-parallel shards; an adapter, saved from its slot's values), and off
        rank 0."""
        if self.views.master_names() is None:
            return None
        if self.memory.shard is not None:  # collective: every rank sends its shard
            with self.phases.optimizer_state_in_reach():
                mine = self.optimizer.state_dict()
            return distributed.gather_objects({"ranges": mine["ranges"], "master_weights": mine["master_weights"]},
                                              self.world)
        flat = getattr(self.optimizer, "master_flat", None)
        if flat is None or not self.world.is_main:
            return None
        with self.phases.optimizer_state_in_reach():
            return {"master_weights": flat.detach().to("cpu", copy=True)}

    @staticmethod
    def _shard_kind(world: distributed.World) -> str:
        """The name of this rank's ZeRO-1 optimizer shard files (optimizer_shard_path's kind)."""
        return "rank" if world.tp_size == 1 else f"tp{world.tp_rank}-rank"

    def _check_ranks_agree(self, step: int) -> None:
        """Every rank applies the same averaged update, so their weights must be identical; rank 0's
        checkpoint stands for all of them only if they are."""
        if self.world.size == 1:
            return
        with torch.no_grad():
            digest = float(sum(p.sum(dtype=torch.float64) for p in self.views.parameters()))
        # The ranks holding the same shards (the same tensor-parallel rank of every engine) must agree.
        digests = distributed.gather_objects(digest, self.world)[self.world.tp_rank::self.world.tp_size]
        if max(digests) - min(digests) > 1e-9 * max(1.0, abs(digest)):
            raise RuntimeError(f"the ranks' weights diverged at step {step} (parameter sums {digests}); "
                               "gradients were not averaged identically")

    def _optimizer_state(self) -> dict:
        """The optimizer's state dict, readable even while its region sleeps (from the host copy)."""
        with self.phases.optimizer_state_in_reach():
            return copy.deepcopy(self.optimizer.state_dict())
