"""`python -m colo.grpo` run as a user runs it, in the repository, alone or as the ranks of a torchrun
job, and the step records it writes (OUT/log.jsonl). The end-to-end GRPO tests share these.

`launch` forks each process from a server that has imported torch, transformers and vLLM
(helpers/forked.py); `torchrun_command` is the command itself, for the tests about torchrun's own
launcher."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import free_port

from helpers.forked import run_python, run_python_ranks

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TQDM_DISABLE": "1"}


def grpo_args(out: Path, *extra: str) -> list[str]:
    """The arguments of `python -m colo.grpo` for a run writing into OUT."""
    return ["--json", str(out / "log.jsonl"), "--out", str(out), "--no-progress", *extra]


def launch(out: Path, *extra: str, ranks: int = 1, port: int | None = None,
           timeout: float = 420) -> subprocess.CompletedProcess:
    """`python -m colo.grpo --json OUT/log.jsonl --out OUT --no-progress EXTRA`: one process, or the ranks
    of a one-node torchrun job."""
    args = grpo_args(out, *extra)
    if ranks == 1:
        return run_python("colo.grpo", args, ENV, cwd=REPO, timeout=timeout)
    return run_python_ranks("colo.grpo", args, ENV, ranks=ranks, cwd=REPO, timeout=timeout, port=port)


def run_grpo(out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = launch(out, *extra, timeout=timeout)
    assert done.returncode == 0, failure_report(done.stderr)
    return done


def run_grpo_ranks(out: Path, ranks: int, *extra: str, port: int | None = None) -> subprocess.CompletedProcess:
    done = launch(out, *extra, ranks=ranks, port=port)
    assert done.returncode == 0, failure_report(done.stderr)
    return done


def failure_report(stderr: str) -> str:
    """What a failed run wrote: each distinct error line first (a rank's own, which torchrun's report
    after it pushes out of a short tail), then the tail."""
    errors = dict.fromkeys(line for line in stderr.splitlines()
                           if re.search(r"Error|Traceback|terminate called|not initialized|Signal|signal", line))
    return "error lines:\n" + "\n".join(errors)[-4000:] + "\n...\n" + stderr[-3000:]


def torchrun_command(out: Path, ranks: int, *extra: str, port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(port or free_port()), "-m", "colo.grpo", *grpo_args(out, *extra)]



def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
