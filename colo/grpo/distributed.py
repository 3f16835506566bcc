"""The little torch.distributed a colocated GRPO run needs: one engine per rank, prompts split as evenly as the ranks allow,
gradients averaged with one all-reduce per flat buffer, small results summed or gathered.

With tensor parallelism (T ranks per engine) the world is D data-parallel groups of T consecutive
ranks (vLLM's layout under its external launcher): the T ranks of a group hold one engine's shards
and see the same prompts; prompts are split, and gradients averaged, over the D ranks that hold the
same shards (`World.dp_group`).

Works unchanged in a single process (world size 1), where every helper is the identity.
"""
from __future__ import annotations

import dataclasses
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
    tp_size: int = 1     # ranks per engine (tensor parallelism)
    dp_group: object = None  # the ranks holding the same shards as this one (None: every rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size


def init_world(device_type: str, tensor_parallel: int = 1) -> World:
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
    world = World(0, 1, 0)
    if dist.is_initialized():
        device = f"cuda:{local_rank}" if dist.get_backend() == "nccl" else "cpu"
        world = World(dist.get_rank(), dist.get_world_size(), local_rank, device)
    if tensor_parallel == 1:
        return world
    check_tensor_parallel(tensor_parallel, world.size)
    # Every rank takes part in creating every group (torch's rule); a group of one where there is one
    # engine, so a sharded optimizer sees its own data-parallel world.
    groups = [list(range(t, world.size, tensor_parallel)) for t in range(tensor_parallel)]
    dp_group, _ = dist.new_subgroups_by_enumeration(groups)
    return dataclasses.replace(world, tp_size=tensor_parallel, dp_group=dp_group)


def check_tensor_parallel(tensor_parallel: int, ranks: int) -> None:
    """ValueError unless `tensor_parallel` (the ranks one engine spans) divides the number of `ranks` launched."""
    if ranks % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} must divide the number of ranks ({ranks}): "
                         f"launch torchrun with a multiple of {tensor_parallel} processes")


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
    """The indices of `count` items that data-parallel rank `rank` (default: this one's) takes:
    contiguous, as even as possible (the first count % dp_size ranks take one more)."""
    rank = world.dp_rank if rank is None else rank
    base, extra = divmod(count, world.dp_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def average_(tensors: list[torch.Tensor], world: World) -> None:
    """In-place mean over the data-parallel ranks (each tensor one collective: pass flat buffers, not
    parameters)."""
    if world.dp_size == 1:
        return
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=world.dp_group)
        t.div_(world.dp_size)


def sum_floats(values: list[float], world: World, data_parallel: bool = False) -> list[float]:
    """Sums over every rank, or with data_parallel=True over the ranks holding this one's shards
    (each batch counted once: the tensor-parallel ranks of an engine share theirs)."""
    if (world.dp_size if data_parallel else world.size) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=world.dp_group if data_parallel else None)
    return t.tolist()


def min_max(low: float, high: float, world: World) -> tuple[float, float]:
    """(smallest `low`, largest `high`) over the data-parallel ranks."""
    if world.dp_size == 1:
        return low, high
    t = torch.tensor([-low, high], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.dp_group)
    return -t[0].item(), t[1].item()


def gather_objects(obj, world: World) -> list:
    if world.size == 1:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()
