"""`python -m colo.gpu_check`, the command for a lent GPU, run here as it runs there but on the host
pool (--device cpu): every check that applies passes and the report says what each saw."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_checks_on_the_host_pool_and_writes_one_report(tmp_path):
    report_path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "colo.gpu_check", "--device", "cpu", "--json", str(report_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    status = {c["check"]: c["status"] for c in report["checks"]}
    assert status == {"pool_sleep_wake": "passed", "mempool_routing": "skipped", "streams_and_events": "passed",
                      "overlap_handover": "passed", "zero1_math": "passed", "chunked_logprobs": "passed",
                      "moe_router_replay": "passed", "share_check_rounding": "passed"}
    details = {c["check"]: c["details"] for c in report["checks"]}
    assert details["pool_sleep_wake"]["backend"].startswith("host")
    assert details["overlap_handover"]["largest_relative_gradient_gap"] <= 1e-5
    assert report["environment"]["torch"] == torch.__version__ and report["failed"] == 0


def test_without_a_gpu_it_says_so_and_how_to_run_on_the_host():
    if torch.cuda.is_available():
        return
    done = subprocess.run([sys.executable, "-m", "colo.gpu_check"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 2 and "--device cpu" in done.stderr
