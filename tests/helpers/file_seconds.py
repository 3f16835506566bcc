"""`python tests/helpers/file_seconds.py PYTEST_LOG COMMIT [CPU_KIND_LOG]`: write tests/file_seconds.json,
the seconds of each test file's tests in a `python -m pytest -n 2 --durations=0` pass (its log), and in a
persona pass of the cpu_kind tests alone (`python -m colo.cpu_persona avx2 -- python -m pytest -n 2
-m cpu_kind --durations=0`, as .ci/run runs them), which tests/conftest.py reads to start the longest
files first."""
from __future__ import annotations

import collections
import json
import platform
import re
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "file_seconds.json"


def file_seconds(log_text: str) -> dict[str, float]:
    """{test file: seconds of its tests' setup, call and teardown} from pytest's --durations=0 lines."""
    seconds: collections.Counter = collections.Counter()
    for line in log_text.splitlines():
        found = re.match(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::", line)
        if found:
            seconds[found.group(2)] += float(found.group(1))
    return {name: round(value, 1) for name, value in seconds.most_common() if value >= 1.0}


def main(log_path: str, commit: str, cpu_kind_log_path: str | None = None) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    OUT.write_text(json.dumps({
        "what": "seconds of each test file's tests in one `python -m pytest -n 2 --durations=0` pass; "
                "tests/conftest.py starts the longest files first",
        "command": f"python tests/helpers/file_seconds.py {Path(log_path).name} {commit}",
        "machine": f"{cpu}, {len(__import__('os').sched_getaffinity(0))} cores", "commit": commit,
        "date": time.strftime("%Y-%m-%d"), "seconds": file_seconds(Path(log_path).read_text()),
        **({"cpu_kind_command": "python -m colo.cpu_persona avx2 -- python -m pytest -n 2 -m cpu_kind --durations=0",
            "cpu_kind_seconds": file_seconds(Path(cpu_kind_log_path).read_text())} if cpu_kind_log_path else {}),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
