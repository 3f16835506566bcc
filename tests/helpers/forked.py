"""`python -m MODULE ARGS` or `python SCRIPT.py ARGS` in a fresh process that does not import torch,
transformers and vLLM again: forked from multiprocessing's fork server, which has imported them once
per test worker (the bench's, colo.bench.measure.preloaded_fork_context: colo is not among them, so
that stock TRL's processes are as a user's) and run nothing else (no engine, pool or process group),
with the environment, working directory, argv and exit status that the command would have. A launch
of `python -m colo.grpo` spends about 11 s of CPU in those imports alone, and the end-to-end tests
launch it dozens of times.

`run_python_ranks` starts several such processes as torchrun starts its ranks on one node (its
environment variables; rank 0 serves the store at MASTER_PORT) and, as torchrun does, stops the others
when one fails. Tests that are about torchrun itself (two nodes, two jobs on one host) run torchrun.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from colo.bench.measure import preloaded_fork_context


class Started:
    """A forked `python -m TARGET ARGS` (`python TARGET ARGS` where TARGET is a .py file) that runs on,
    held as subprocess.Popen holds a started command (the calls the tests make of it); its stdout and
    stderr go to files, read by communicate()."""

    def __init__(self, target: str, args: list[str], env: dict, *, cwd: Path):
        self._logs = tempfile.TemporaryDirectory()
        target, args = str(target), [str(a) for a in args]
        self.args = [sys.executable, *([target] if target.endswith(".py") else ["-m", target]), *args]
        self.process = preloaded_fork_context().Process(target=_main,
                                                        args=(target, args, env, str(cwd), self._logs.name))
        saved = dict(os.environ)
        os.environ.update(env)  # the fork server (started by the first launch) imports under the runs' environment
        try:
            self.process.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        return tuple(Path(self._logs.name, name).read_text(errors="replace") for name in ("stdout", "stderr"))


def run_python(target: str, args: list[str], env: dict, *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return _run([Started(target, args, env, cwd=cwd)], timeout)


def run_python_ranks(target: str, args: list[str], env: dict, *, ranks: int, cwd: Path, timeout: float,
                     port: int | None = None) -> subprocess.CompletedProcess:
    """The ranks' exit status (the first failure's, else 0), and their stdout and stderr, rank after rank."""
    from conftest import free_port

    world = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port or free_port())}
    return _run([Started(target, args, {**env, **world, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=cwd)
                 for r in range(ranks)], timeout)


def _run(started: list[Started], timeout: float) -> subprocess.CompletedProcess:
    try:
        status = _first_failure(started, timeout)
    finally:
        _stop(started)
    stdout, stderr = ("".join(parts) for parts in zip(*(s.output() for s in started)))
    return subprocess.CompletedProcess(started[0].args, status, stdout, stderr)


def _first_failure(started: list[Started], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    running = list(started)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(started[0].args, timeout)
        for sentinel in multiprocessing.connection.wait([s.process.sentinel for s in running], timeout=left):
            ended = next(s for s in running if s.process.sentinel == sentinel)
            running.remove(ended)
            if ended.wait() != 0:
                return ended.returncode
    return 0


def _stop(started: list[Started]) -> None:
    """Torchrun's way with the ranks left when one fails: SIGTERM, then SIGKILL."""
    for s in started:
        s.send_signal(signal.SIGTERM)
    for s in started:
        try:
            s.wait(10)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait()


def _main(target: str, args: list[str], env: dict, cwd: str, logs: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        file = os.open(f"{logs}/{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.argv = [target, *args]
    if target.endswith(".py"):  # sys.path[0] as python sets it: the script's folder, or for -m the working directory
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.path.insert(0, cwd)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
