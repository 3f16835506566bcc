"""colo.grpo.distributed: a GPU rank makes its device current before it joins NCCL and names it to
the process group, and leave_world destroys the group init_world started and no other (no GPU, no
torchrun: monkeypatched, or one rank in a fresh process); and the ranks of a job agree on the dtype auto
picks."""
import torch


def test_a_gpu_rank_sets_its_device_before_joining_nccl_and_names_it(monkeypatch):
    """Under torchrun each rank's device is LOCAL_RANK, made current before the process group (and any
    barrier) exists and given to NCCL as device_id, so nothing falls back to cuda:0."""
    from colo.grpo import distributed

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: bool(calls) and calls[-1][0] == "init")
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    world = distributed.init_world("cuda")
    assert calls == [("set_device", 1), ("init", "nccl", {"device_id": torch.device("cuda", 1)})]
    assert world == distributed.World(rank=1, size=2, local_rank=1, device="cuda:1")


_LEAVE_WORLD_SCRIPT = """
import os
import torch.distributed as dist
from colo.grpo import distributed

def one_rank_group(*args, **kwargs):
    init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

init_process_group = dist.init_process_group
one_rank_group()  # a caller's own group: init_world joins it, leave_world leaves it alone
assert distributed.init_world("cpu") == distributed.World(rank=0, size=1, local_rank=0)
distributed.leave_world()
assert dist.is_initialized()
dist.destroy_process_group()

os.environ["WORLD_SIZE"] = "2"  # as under torchrun; the group itself is a one-rank one
dist.init_process_group = one_rank_group
distributed.init_world("cpu")
assert dist.is_initialized()
distributed.leave_world()
assert not dist.is_initialized()
distributed.leave_world()  # twice is harmless
print("leave_world ok")
"""


def test_leave_world_destroys_the_group_init_world_started_and_no_other():
    # In a fresh process: torch.distributed's default group is per process, and an engine built by an
    # earlier test in this one may hold it.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _LEAVE_WORLD_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "leave_world ok" in run.stdout, run.stderr[-2000:]


_DTYPE_RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from colo import dtype_choice
from colo.grpo import GRPOConfig
from colo.grpo.distributed import World

rank, store, slowdown = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
# An AVX512_BF16 CPU without AMX, whose timed matmul comes out on a different side of 1 on each rank.
torch.cpu.get_capabilities = lambda: {"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bf16": True}
dtype_choice.measured_bf16_slowdown = lambda: slowdown
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
own = dtype_choice.fastest_dtype("cpu").name
agreed = GRPOConfig().resolve_dtype("cpu", World(rank, 2, rank)).dtype
dist.destroy_process_group()
print(json.dumps([own, agreed]))
"""


def test_the_ranks_of_a_job_take_rank_0s_dtype_where_each_timed_its_own(tmp_path):
    """Where auto rests on a timed matmul (colo.dtype_choice), ranks could time either side of 1: every
    rank takes rank 0's choice, so one job never mixes bf16 and fp32 engines. Two gloo ranks in fresh
    processes."""
    import json
    import subprocess
    import sys

    ranks = [subprocess.Popen([sys.executable, "-c", _DTYPE_RANK_SCRIPT, str(rank), str(tmp_path / "store"), slowdown],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, slowdown in ((0, "0.8"), (1, "1.2"))]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outputs]
    assert [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs] == [["bf16", "bf16"], ["fp32", "bf16"]]
