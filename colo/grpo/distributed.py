"""The little torch.distributed a colocated GRPO run needs: one engine per rank, prompts split as evenly as the ranks allow,
gradients averaged with one all-reduce per flat buffer, small results summed or gathered.

Works unchanged in a single process (world size 1), where every helper is the identity.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: str = "cpu"  # where small collectives run: NCCL takes only CUDA tensors

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device_type: str) -> World:
    """Join the torchrun group if launched by torchrun (gloo on CPU, NCCL on GPU); else one rank.

    On a GPU the rank's device (LOCAL_RANK) is made current first and named to NCCL, so neither
    the group nor anything after it (a barrier, the engine, colo.Pool("cuda")) guesses device 0.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if size > 1 and not dist.is_initialized():
        # vLLM's external launcher needs the default group to exist before the engine is built.
        if device_type == "cuda":
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
        global _started_here
        _started_here = dist.group.WORLD
    if dist.is_initialized():
        device = f"cuda:{local_rank}" if dist.get_backend() == "nccl" else "cpu"
        return World(dist.get_rank(), dist.get_world_size(), local_rank, device)
    return World(0, 1, 0)


# The default group init_world made, if it made one: leave_world destroys that only (a caller's own
# group is the caller's to destroy).
_started_here = None


def leave_world() -> None:
    """Destroy the process group init_world started (NCCL frees its communicators and buffers only
    then; torch warns at exit otherwise). Call once every rank is done with it, on the way out."""
    global _started_here
    if _started_here is not None and dist.is_initialized() and dist.group.WORLD is _started_here:
        dist.destroy_process_group()
    _started_here = None


def rank_share(count: int, world: World, rank: int | None = None) -> range:
    """The indices of `count` items that `rank` (default: this one) takes: contiguous, as even as
    possible (the first count % size ranks take one more)."""
    rank = world.rank if rank is None else rank
    base, extra = divmod(count, world.size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def average_(tensors: list[torch.Tensor], world: World) -> None:
    """In-place mean over ranks (each tensor one collective: pass flat buffers, not parameters)."""
    if world.size == 1:
        return
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(world.size)


def sum_floats(values: list[float], world: World) -> list[float]:
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def gather_objects(obj, world: World) -> list:
    if world.size == 1:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()
