"""Tool worker processes (colo.grpo.tool_workers): a killed worker takes all it started with it, a dead one is
seen from its process ending, an answer that does not unpickle is an error result, and a call given up
while it waits for a worker never runs.

The tools are defined inside the tests: cloudpickle sends them by value, so a worker imports neither this
file nor torch."""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from colo.grpo import sandbox
from colo.grpo.tool_workers import ToolWorkers, WorkerDied
from colo.grpo.tools import ToolCall, ToolRunner


def alive(pid: int) -> bool:
    return pid in {p.pid for p in sandbox.processes()}


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def read_pids(path: str) -> list[int]:
    with open(path) as f:
        return [int(pid) for pid in f.read().split()]


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_worker_takes_what_its_tool_started_with_it(tmp_path):
    where = str(tmp_path / "pids")

    def spawner() -> str:
        import os
        import subprocess
        import time
        same = subprocess.Popen(["sleep", "60"])
        own = subprocess.Popen(["sleep", "60"], start_new_session=True)   # as a sandboxed program is
        with open(where + ".part", "w") as f:
            f.write(f"{same.pid} {own.pid}")
        os.replace(where + ".part", where)
        time.sleep(60)
        return "done"

    workers = ToolWorkers({"spawner": spawner}, size=1)
    children = []
    try:
        future = workers.submit("spawner", {})
        wait_until(lambda: os.path.exists(where))
        children = read_pids(where)
        workers.kill(future)
        with pytest.raises(WorkerDied, match="died"):
            future.result(timeout=30)
        assert [pid for pid in children if alive(pid)] == []
    finally:
        workers.close()
        kill_all(children)


def test_a_killed_worker_takes_its_sandbox_with_it():
    """Killed mid-run, a worker never runs run_python's clean-up: the pool ends the program, whatever session
    its processes made, and removes its directory."""
    if not sandbox.privileges_dropped():
        pytest.skip("sandboxed programs do not run as a uid of their own here: a process that leaves the "
                    "program's session is not found")
    path = sandbox.__file__

    def sandboxed() -> str:
        import importlib.util
        import sys
        spec = importlib.util.spec_from_file_location("colo_sandbox_alone", path)   # without torch
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        module._AUDIT_HOOK = False   # so the program can fork a process into a session of its own
        return module.run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)").text

    def in_sandbox(directory: str) -> list[int]:
        found = []
        for p in sandbox.processes():
            try:
                if os.readlink(f"/proc/{p.pid}/cwd") == directory:
                    found.append(p.pid)
            except OSError:
                pass
        return found

    workers = ToolWorkers({"sandboxed": sandboxed}, size=1)
    programs = []
    try:
        future = workers.submit("sandboxed", {})
        worker, = [p.pid for p in sandbox.processes()
                   if p.ppid == os.getpid() and b"tool_worker_main" in Path(f"/proc/{p.pid}/cmdline").read_bytes()]
        mine = f"colo-sandbox-{worker}-"   # not the worker's first, which only probes, nor another process's

        def running() -> list[int]:
            names = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)]
            return in_sandbox(os.path.join(tempfile.gettempdir(), names[0])) if names else []

        wait_until(lambda: len(running()) == 2)   # the program and its child in a session of its own
        directory = os.readlink(f"/proc/{running()[0]}/cwd")
        programs = in_sandbox(directory)
        workers.kill(future)
        with pytest.raises(WorkerDied):
            future.result(timeout=30)
        assert [pid for pid in programs if alive(pid)] == [] and not os.path.exists(directory)
    finally:
        workers.close()
        kill_all(programs)


def test_a_dead_worker_is_seen_though_a_process_it_forked_keeps_its_socket(tmp_path):
    where = str(tmp_path / "pid")

    def forker() -> str:
        import os
        import time
        if os.fork() == 0:   # out of the worker's reach: a grandchild in a session of its own
            os.setsid()
            if os.fork() == 0:
                with open(where + ".part", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(where + ".part", where)
                time.sleep(60)
            os._exit(0)
        time.sleep(60)
        return "done"

    def add(a: int, b: int) -> int:
        return a + b

    workers = ToolWorkers({"forker": forker, "add": add}, size=1)
    holder = []
    try:
        future = workers.submit("forker", {})
        wait_until(lambda: os.path.exists(where))
        holder = read_pids(where)
        workers.kill(future)
        with pytest.raises(WorkerDied):
            future.result(timeout=30)
        assert workers.submit("add", {"a": 2, "b": 3}).result(timeout=30) == "5" and workers.replaced == 1
    finally:
        workers.close()
        kill_all(holder)


@pytest.mark.parametrize("case", ["an answer that does not unpickle", "an error whose str() raises"])
def test_what_cannot_be_read_is_an_error_and_the_worker_goes_on(case):
    """An answer that pickles in the worker but not back in the trainer, and an error the tool raises whose
    str() raises too (named by its type): an error result each, the worker alive for the next call."""
    class OnlyThere:
        def __reduce__(self):   # pickles in the worker; rebuilding it in the trainer raises
            return int, ("not a number",)

    def odd() -> list:
        return [OnlyThere()]

    def broken() -> str:
        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("no words")

        raise Unprintable()

    def add(a: int, b: int) -> int:
        return a + b

    tool, error, message = {"an answer that does not unpickle": (odd, RuntimeError, "could not be read in the trainer: "
                                                                 "ValueError"),
                            "an error whose str() raises": (broken, Exception, "Unprintable")}[case]
    workers = ToolWorkers({"tool": tool, "add": add}, size=1)
    try:
        with pytest.raises(error, match=message):
            workers.submit("tool", {}).result(timeout=30)
        assert workers.submit("add", {"a": 2, "b": 3}).result(timeout=30) == "5" and workers.replaced == 0
    finally:
        workers.close()


def test_a_calls_deadline_counts_from_when_a_worker_takes_it_and_one_given_up_while_it_waits_never_runs(tmp_path):
    """Waiting for a free worker is not the tool's time: a call queued behind another runs its full timeout
    once it starts. A call given up while it waits (killed) never runs."""
    marker = str(tmp_path / "ran")

    def slow() -> str:
        import time
        time.sleep(0.6)
        return "slow"

    def mark() -> str:
        open(marker, "w").close()
        return "marked"

    workers = ToolWorkers({"slow": slow, "mark": mark}, size=1)
    runner = ToolRunner(timeout=1.0, workers=workers)
    try:
        calls = [runner.submit(ToolCall("slow", {}), {"slow": slow}) for _ in range(2)]
        wait_until(lambda: workers.started(calls[0].future) is not None)
        killed = workers.submit("mark", {})
        assert workers.started(calls[1].future) is None and calls[1].due() is None   # waiting: no deadline yet
        workers.kill(killed)
        assert killed.cancelled()
        wait_until(lambda: all(c.ready(time.perf_counter()) for c in calls))
        results = [c.result(1.0) for c in calls]
        # the second finished more than a timeout after it was submitted, but within one of its start
        assert [r.content for r in results] == ["slow", "slow"] and not any(r.timed_out for r in results)
        assert results[1].seconds > 1.0
        fresh = workers.submit("slow", {})
        submitted = time.perf_counter()
        wait_until(lambda: workers.started(fresh) is not None)
        assert workers.started(fresh) - submitted < 0.5   # nothing given up ran before it
        assert fresh.result(timeout=30) == "slow" and not os.path.exists(marker)
    finally:
        runner.close()
        workers.close()


def test_a_crashed_worker_is_replaced_and_a_closed_pool_fails_what_waits():
    def crash() -> str:
        import os
        os._exit(3)

    def add(a: int, b: int) -> int:
        return a + b

    workers = ToolWorkers({"crash": crash, "add": add}, size=1)
    with pytest.raises(WorkerDied, match="exit code 3"):
        workers.submit("crash", {}).result(timeout=30)
    assert workers.submit("add", {"a": 1, "b": 1}).result(timeout=30) == "2" and workers.replaced == 1
    workers.close()
    with pytest.raises(WorkerDied, match="closed"):
        workers.submit("add", {"a": 1, "b": 1}).result(timeout=30)
