"""One rank of tests/optimizers/test_zero.py (run under torchrun, or alone as a world of one).

    python tests/helpers/zero_worker.py MODE OUT STEPS [RESUME_DIR]

MODE: "in-place" (bf16 parameters in a colo region: the all-gather lands in them), "in-place-fp32"
(the same in fp32: the parameters are their own masters) or "private" (ordinary bf16 tensors). Trains
the toy problem (helpers/zero_toy.py) for STEPS steps with colo.ShardedMasterWeightOptimizer, each
rank on its share of the batch, and writes OUT/rank{r}.pt: the final weights, the gradient norms and
this rank's optimizer state_dict(). RESUME_DIR: first load every rank{r}.pt there (any number of
ranks) and continue.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where the helpers package is
from helpers.zero_toy import batch, build_groups, build_params, loss_fn  # noqa: E402

import colo  # noqa: E402
from colo.grpo.distributed import World, rank_share  # noqa: E402


def main(mode: str, out: str, steps: int, resume: str | None = None) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    pool = colo.Pool("cpu", capacity=64 << 20)
    region = pool.region("weights", budget=4 << 20)
    params = build_params(region if mode.startswith("in-place") else None,
                          torch.float32 if mode.endswith("fp32") else torch.bfloat16)
    optimizer = colo.ShardedMasterWeightOptimizer(build_groups(params), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                                  store_region=region, grad_region=pool.region("grads", budget=4 << 20))
    assert optimizer.layout.in_place == mode.startswith("in-place"), optimizer.layout.in_place
    norms, done = [], 0
    if resume:
        shards = [torch.load(path, weights_only=True) for path in sorted(Path(resume).glob("rank*.pt"))]
        optimizer.load_state_dict([s["optimizer"] for s in shards])
        done = shards[0]["steps"]
    x, y = batch()
    for step in range(done, steps):
        rows = rank_share(len(x), World(rank, world, rank))
        loss_fn(params, x[rows.start:rows.stop], y[rows.start:rows.stop]).backward()
        norms.append(optimizer.clip_grad_norm_(1.0))
        optimizer.step()
        optimizer.zero_grad()
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save({"weights": [p.detach().clone() for p in params], "norms": norms, "steps": steps,
                "optimizer": optimizer.state_dict(), "state_bytes": optimizer.state_bytes(),
                "copied_bytes_per_step": optimizer.copied_bytes_per_step,
                "owned_numel": optimizer.layout.owned_numel, "store_numel": optimizer.layout.numel}, Path(out) / f"rank{rank}.pt")
    # gloo's teardown aborts now and then ("terminate called without an active exception": with
    # destroy_process_group() 1 run in 6 with 3 ranks, and also at interpreter exit without it), after
    # the results are on disk; so once every rank has written its own, leave without tearing it down.
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
