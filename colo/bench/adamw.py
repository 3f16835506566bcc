"""`python -m colo.bench.adamw --json PATH`: one AdamW step over SmolLM2-135M's parameter count in fp32,
in its 272 tensors' sizes and as one flat tensor, torch's default implementation against its fused one
(transformers' default optimizer, `adamw_torch_fused`, which colo.grpo uses too).
A record, not a test: seconds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path


def step_seconds(sizes: list[int], repeats: int = 3, **adamw) -> float:
    """The median seconds of one AdamW step over fp32 tensors of `sizes`, after a first step (the moments'
    allocation) left out."""
    import torch

    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel()) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-5, **adamw)
    optimizer.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def smollm2_sizes() -> list[int]:
    """SmolLM2-135M's parameter sizes (its config, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colo.smollm2 import smollm2_dir

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_dir()))
    return [p.numel() for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colo.bench.adamw", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the record")
    args = parser.parse_args(argv)

    from .machine import machine_info

    sizes = smollm2_sizes()
    rows = []
    for layout, shapes in (("SmolLM2-135M's tensors", sizes), ("one flat tensor", [sum(sizes)])):
        default = step_seconds(shapes)
        fused = step_seconds(shapes, fused=True)
        rows.append({"layout": layout, "tensors": len(shapes), "values": sum(shapes), "default_s": default,
                     "fused_s": fused, "fused_vs_default": fused / default})
        print(rows[-1], file=sys.stderr, flush=True)
    record = {"command": "python -m colo.bench.adamw " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "rows": rows}
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
