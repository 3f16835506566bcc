"""`python -m colo.grpo` run as a user runs it: a subprocess in the repository, alone or under torchrun,
and the step records it writes (OUT/log.jsonl). The end-to-end GRPO tests share these."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TQDM_DISABLE": "1"}


def grpo_command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "colo.grpo", "--json", str(out / "log.jsonl"), "--out", str(out),
            "--no-progress", *extra]


def run_grpo(out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(grpo_command(out, *extra), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=ENV)
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
            "--master_port", str(port or free_port()), "-m", "colo.grpo", *grpo_command(out, *extra)[3:]]


def torchrun(out: Path, ranks: int, *extra: str, port: int | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(torchrun_command(out, ranks, *extra, port=port), capture_output=True, text=True,
                          timeout=420, cwd=REPO, env=ENV)
    assert done.returncode == 0, failure_report(done.stderr)
    return done


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
