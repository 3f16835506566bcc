"""A pytest plugin that measures each test file's peak memory, for tests/file_memory.json:
`python -m pytest -p no:xdist -p helpers.file_memory FILES...` (from tests/, or with tests/ on PYTHONPATH)
samples the resident memory of every python process on the machine (the test process, its engines and
subprocesses) every 0.3 s while each file's tests run, and writes {file: peak GiB} to $FILE_MEMORY_OUT
(default file_memory.peaks.json). Run it alone on the machine: any other python process counts too."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

_running: dict = {"file": None}
_peaks: dict[str, float] = {}


def _python_resident_gib() -> float:
    pages = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as comm, open(f"/proc/{pid}/statm") as statm:
                name = comm.read()
                if "python" in name or "pytest" in name:
                    pages += int(statm.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def _sample() -> None:
    while True:
        name = _running["file"]
        if name is not None:
            _peaks[name] = max(_peaks.get(name, 0.0), _python_resident_gib())
        time.sleep(0.3)


def pytest_sessionstart(session):
    threading.Thread(target=_sample, daemon=True).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["file"] = item.nodeid.split("::")[0]
    yield
    _running["file"] = None


def pytest_sessionfinish(session):
    with open(os.environ.get("FILE_MEMORY_OUT", "file_memory.peaks.json"), "w") as out:
        json.dump({name: round(gib, 1) for name, gib in sorted(_peaks.items())}, out, indent=1)
