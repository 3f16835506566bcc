"""`python -m colo.bench.huge_pages --json PATH [--grpo-steps N]`: torch's CPU tensors on 4 KiB pages against
transparent huge pages (torch's THP_MEM_ALLOC_ENABLE=0 against 1, which `import colo` sets), each in a fresh
interpreter: the operations of a bf16 GRPO step on SmolLM2's shapes that make new tensors, and, with
`--grpo-steps`, colo.grpo's step on the real task (colo.bench.trl_task.run_grpo_side).
A record, not a test: seconds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, setup, timed statement): a chunk of the head's logits (256 positions x SmolLM2's vocabulary) cast to
# fp32 and log-softmaxed, the head's weight gradient of a chunk taken to fp32, a finiteness check over every
# fp32 gradient of 135M parameters, as torch.isfinite makes it and as colo.clipping makes it
OPERATIONS = [
    ("logits chunk bf16 -> fp32", "x = torch.randn(256, 49152).bfloat16()", "x.float()"),
    ("log_softmax of an fp32 chunk", "x = torch.randn(256, 49152)", "x.log_softmax(-1)"),
    ("head weight gradient of a chunk, to fp32", "g = torch.randn(49152, 256).bfloat16(); "
     "h = torch.randn(256, 576).bfloat16()", "(g @ h).float()"),
    ("isfinite over 135M fp32 gradients", "g = torch.randn(134515008)", "bool(torch.isfinite(g).all())"),
    # colo.clipping.gradients_finite since (aminmax), which allocates nothing
    ("aminmax over 135M fp32 gradients", "from colo.clipping import gradients_finite; g = torch.randn(134515008)",
     "gradients_finite([g])"),
]

TIMING = """
import json, statistics, time, torch
out = {}
for name, setup, statement in json.loads(OPERATIONS):
    scope = {"torch": torch}
    exec(setup, scope)
    exec(statement, scope)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter(); exec(statement, scope); times.append(time.perf_counter() - start)
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def in_interpreter(code: str, huge_pages: bool) -> dict:
    """The JSON `code` prints last, run by a fresh interpreter with THP_MEM_ALLOC_ENABLE set (1 or 0) before
    torch is imported."""
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if huge_pages else "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def operation_seconds(huge_pages: bool, repeats: int = 10) -> dict:
    code = TIMING.replace("OPERATIONS", repr(json.dumps(OPERATIONS))).replace("REPEATS", str(repeats))
    return in_interpreter(code, huge_pages)


def grpo_step(huge_pages: bool, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="colo-huge-pages-") as out:
        code = ("import json, colo.bench.trl_task as t; "
                f"print(json.dumps(t.run_grpo_side({str(Path(out) / 'run')!r}, {steps})))")
        return in_interpreter(code, huge_pages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colo.bench.huge_pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the record")
    parser.add_argument("--grpo-steps", type=int, default=0,
                        help="also colo.grpo on the real task, this many steps each way (the first a warm-up)")
    args = parser.parse_args(argv)
    if args.grpo_steps == 1:
        parser.error("--grpo-steps must be 0 or at least 2 (the first is a warm-up)")

    from .machine import machine_info

    sides = {}
    for name, huge in (("4 KiB pages", False), ("huge pages", True)):
        sides[name] = {"operations_s": operation_seconds(huge)}
        if args.grpo_steps:
            sides[name]["colo.grpo"] = grpo_step(huge, args.grpo_steps)
        print(name, sides[name], file=sys.stderr, flush=True)
    small, huge = sides["4 KiB pages"], sides["huge pages"]
    record = {"command": "python -m colo.bench.huge_pages " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "sides": sides,
              "huge_vs_small_pages": {op: huge["operations_s"][op] / small["operations_s"][op]
                                      for op in small["operations_s"]}}
    if args.grpo_steps:
        record["grpo_step_huge_vs_small_pages"] = huge["colo.grpo"]["wall_s"] / small["colo.grpo"]["wall_s"]
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
