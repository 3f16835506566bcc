"""`python -m colo.grpo` run as a user runs it: a subprocess in the repository, alone or under torchrun,
and the step records it writes (OUT/log.jsonl). The end-to-end GRPO tests share these."""
from __future__ import annotations

import json
import os
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
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def torchrun(out: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port()),
           "-m", "colo.grpo", *grpo_command(out, *extra)[3:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=REPO, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
