"""Tool calls in worker processes: a tool that crashes, hangs, exhausts its memory or calls os._exit ends
its worker, not the run.

    workers = ToolWorkers(tools, size=4)      # {name: function}
    future = workers.submit("add", {"a": 1, "b": 2})   # a concurrent.futures.Future of the tool's value
    workers.kill(future)                      # past its deadline: the worker dies, a new one takes its place
    workers.close()

Each worker is a fresh interpreter running colo/grpo/tool_worker_main.py (fork and exec: nothing of the
training process, its vLLM threads, torch's thread pools or the engine's memory, is carried over; it
imports neither colo nor torch), talking to the trainer over a socket pair. The tools are serialized once with cloudpickle, so
lambdas, closures and functions from a user's FILE.py reach the workers as they are. Each worker runs
one call at a time; a call waits for a free worker. A worker that dies in a call (a segfault, os._exit,
killed at its deadline) fails that call's future with `WorkerDied`, naming the exit code, and is
replaced.

Environments (one stateful instance per rollout) and async tools stay in the training process (daemon
threads and an event loop, colo.grpo.tools.ToolRunner): their state lives there.
"""
from __future__ import annotations

import collections
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

from .user_code import USER_MODULE_PREFIX

WORKER_SCRIPT = Path(__file__).with_name("tool_worker_main.py")


class WorkerDied(RuntimeError):
    """The tool's worker process ended during the call."""


class _Worker:
    def __init__(self, blob: bytes):
        mine, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, str(WORKER_SCRIPT), str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.connection = Connection(mine.detach())
        self.connection.send((list(sys.path), blob))
        self.future: Future | None = None


class ToolWorkers:
    """A pool of `size` worker processes running `tools` (see the module docstring)."""

    def __init__(self, tools: dict, size: int = 4):
        import cloudpickle

        self._tools = dict(tools)
        for function in self._tools.values():   # a user's FILE.py (colo.grpo.user_code) is no importable module
            module = sys.modules.get(getattr(function, "__module__", None) or "")
            if module is not None and module.__name__.startswith(USER_MODULE_PREFIX):
                cloudpickle.register_pickle_by_value(module)
        self._blob = cloudpickle.dumps(self._tools)
        self._lock = threading.Lock()
        self._idle = [_Worker(self._blob) for _ in range(size)]
        self._waiting: collections.deque = collections.deque()
        self._busy: dict[int, _Worker] = {}   # id(future) -> its worker
        self._closed = False
        self.replaced = 0                     # workers that died in a call and were replaced

    def runs(self, name: str, tool) -> bool:
        """Whether `tool` is the one these workers run as `name` (not an environment's method of that name)."""
        return self._tools.get(name) is tool

    def submit(self, name: str, arguments: dict) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._idle:
                self._send(self._idle.pop(), future, name, arguments)
            else:
                self._waiting.append((future, name, arguments))
        return future

    def kill(self, future: Future) -> None:
        """End the call of `future`: its worker is killed (and replaced), the future fails with WorkerDied."""
        with self._lock:
            worker = self._busy.get(id(future))
        if worker is not None:
            worker.process.kill()   # its reader thread sees the socket close, fails the future, replaces it

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = [*self._idle, *self._busy.values()]
            self._idle.clear()
            waiting, self._waiting = list(self._waiting), collections.deque()
        for worker in workers:
            worker.process.kill()
            worker.process.wait()
        for future, _, _ in waiting:
            future.set_exception(WorkerDied("the tool workers were closed before the call ran"))

    def _send(self, worker: _Worker, future: Future, name: str, arguments: dict) -> None:
        worker.future = future
        self._busy[id(future)] = worker
        try:
            worker.connection.send((name, arguments))
        except Exception as e:  # noqa: BLE001 - arguments that do not pickle
            self._busy.pop(id(future), None)
            worker.future = None
            self._idle.append(worker)
            future.set_exception(e)
            return
        threading.Thread(target=self._read, args=(worker,), daemon=True, name="colo-tool-reader").start()

    def _read(self, worker: _Worker) -> None:
        try:
            status, value = worker.connection.recv()
        except (EOFError, OSError):
            code = worker.process.wait()
            self._finish(worker, WorkerDied(f"the tool's worker process died (exit code {code})"), alive=False)
            return
        self._finish(worker, value if status == "ok" else RuntimeError(value), alive=True)

    def _finish(self, worker: _Worker, outcome, alive: bool) -> None:
        future = worker.future
        with self._lock:
            self._busy.pop(id(future), None)
            worker.future = None
            if not self._closed:
                if not alive:
                    worker.connection.close()
                    worker = _Worker(self._blob)
                    self.replaced += 1
                if self._waiting:
                    self._send(worker, *self._waiting.popleft())
                else:
                    self._idle.append(worker)
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
