"""Tool calls in worker processes: a tool that crashes, hangs, exhausts its memory or calls os._exit ends
its worker, not the run.

    workers = ToolWorkers(tools, size=4)      # {name: function}
    future = workers.submit("add", {"a": 1, "b": 2})   # a concurrent.futures.Future of the tool's value
    workers.kill(future)                      # past its deadline: the worker dies, a new one takes its place
    workers.close()

Each worker is a fresh interpreter running colo/grpo/tool_worker_main.py (fork and exec: nothing of the
training process, its vLLM threads, torch's thread pools or the engine's memory, is carried over), in a
session of its own, talking to the trainer over a socket pair. The tools are serialized once with
cloudpickle, so lambdas, closures and functions from a user's FILE.py reach the workers as they are.

Each worker runs one call at a time. A call waits in line for a free worker: its future stays pending
meanwhile, so cancel() (or kill()) drops it and it never runs; `started(future)` says when a worker took
it. A worker that dies in a call (a segfault, os._exit, killed at its deadline) fails that call's future
with `WorkerDied`, naming the exit code, and is replaced. Its death is seen from its process ending, not
only from its socket closing, which a process it forked may keep open. A worker killed, or found dead,
takes with it all it started: the processes of its session, those of the sessions its children made (a
sandboxed program's, a tool's `start_new_session` child), and its sandboxes' processes and directories
(colo.grpo.sandbox.end_sandboxes). A result that does not unpickle in the trainer is an error result, and
the worker takes the next call.

Environments (one stateful instance per rollout) and async tools stay in the training process (daemon
threads and an event loop, colo.grpo.tools.ToolRunner): their state lives there.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection, wait
from pathlib import Path

from .sandbox import end_sandboxes, kill_processes, processes
from .user_code import USER_MODULE_PREFIX

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("tool_worker_main.py")
_POLL_S = 0.2   # how often a worker's exit is checked where the kernel has no pidfd
_GRACE_S = 1.0  # how long a worker that closed its socket has to end by itself


class WorkerDied(RuntimeError):
    """The tool's worker process ended during the call."""


class _Worker:
    def __init__(self, blob: bytes):
        mine, theirs = socket.socketpair()
        try:
            # A session of its own: what its tools start stays in it, found and killed with it.
            self.process = subprocess.Popen([sys.executable, str(WORKER_SCRIPT), str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.connection = Connection(mine.detach())
        self.exit_fd = _pidfd(self.process.pid)
        self.future: Future | None = None
        self._end_lock = threading.Lock()
        self.ended = False
        try:
            self.connection.send((list(sys.path), blob))
        except BaseException:
            self.retire()
            raise

    def answered(self) -> bool:
        """Block until the worker answers (True) or its process ends (False)."""
        while True:
            watched = [self.connection] if self.exit_fd is None else [self.connection, self.exit_fd]
            ready = wait(watched, timeout=None if self.exit_fd is not None else _POLL_S)
            if self.connection in ready:
                return True
            if (self.exit_fd is not None and self.exit_fd in ready) or _exited(self.process.pid):
                return False

    def exits_within(self, seconds: float) -> bool:
        """Whether the worker's process ends within `seconds` (left unreaped)."""
        if self.exit_fd is not None:
            return bool(wait([self.exit_fd], timeout=seconds))
        deadline = time.monotonic() + seconds
        while not _exited(self.process.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def end(self) -> None:
        """Kill the worker and all it started (see the module docstring). Before it is waited for: until
        then its pid, hence its session, is still its own."""
        with self._end_lock:
            if self.ended:
                return
            self.ended = True
            pid = self.process.pid
            sessions = {pid} | {p.session for p in processes() if p.ppid == pid}
            kill_processes(lambda p: p.session in sessions)
            end_sandboxes(pid)

    def retire(self) -> None:
        """Killed, waited for, its socket and exit watch closed."""
        self.end()
        self.process.wait()
        self.connection.close()
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None


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
        self._size = size
        self._lock = threading.Lock()
        self._idle = [_Worker(self._blob) for _ in range(size)]
        self._waiting: collections.deque = collections.deque()
        self._busy: dict[int, _Worker] = {}   # id(future) -> its worker
        self._started: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._closed = False
        self.replaced = 0                     # workers that died in a call and were replaced

    def runs(self, name: str, tool) -> bool:
        """Whether `tool` is the one these workers run as `name` (not an environment's method of that name)."""
        return self._tools.get(name) is tool

    def submit(self, name: str, arguments: dict) -> Future:
        """The call's future: pending while it waits for a free worker, running once a worker has it."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(WorkerDied("the tool workers are closed"))
                return future
            self._waiting.append((future, name, arguments))
            self._refill()
            self._dispatch()
        return future

    def started(self, future: Future) -> float | None:
        """When (time.perf_counter()) a worker took the call of `future`; None while it waits for one."""
        with self._lock:
            return self._started.get(future)

    def kill(self, future: Future) -> None:
        """End the call of `future`. One still waiting is cancelled, and never runs. A running one's worker
        is killed with all it started, and replaced; the future fails with WorkerDied."""
        with self._lock:
            worker = self._busy.get(id(future))
            if worker is not None:
                worker.end()   # under the lock: the worker cannot move on to another call meanwhile
                return         # its reader thread sees the process end, fails the future, replaces it
            self._waiting = collections.deque(call for call in self._waiting if call[0] is not future)
        future.cancel()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy.values())
            self._idle.clear()
            waiting, self._waiting = list(self._waiting), collections.deque()
        for worker in busy:
            worker.end()   # their reader threads retire them
        for worker in idle:
            worker.retire()
        for future, _, _ in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(WorkerDied("the tool workers were closed before the call ran"))

    def _refill(self) -> None:
        """Workers up to the pool's size, under the lock; one that fails to start is tried again at the next
        call."""
        while len(self._idle) + len(self._busy) < self._size:
            try:
                self._idle.append(_Worker(self._blob))
            except OSError as e:
                logger.warning("colo.grpo.tool_workers: a tool worker failed to start (%s); trying again at "
                               "the next call", e)
                return

    def _dispatch(self) -> None:
        """Free workers take waiting calls in order, under the lock; a call cancelled while it waited is
        dropped unrun."""
        while self._idle and self._waiting:
            future, name, arguments = self._waiting.popleft()
            if future.set_running_or_notify_cancel():
                self._send(self._idle.pop(), future, name, arguments)

    def _send(self, worker: _Worker, future: Future, name: str, arguments: dict) -> None:
        try:
            worker.connection.send((name, arguments))
        except Exception as e:  # noqa: BLE001 - arguments that do not pickle
            self._idle.append(worker)
            future.set_exception(e)
            return
        worker.future = future
        self._busy[id(future)] = worker
        self._started[future] = time.perf_counter()
        threading.Thread(target=self._read, args=(worker,), daemon=True, name="colo-tool-reader").start()

    def _read(self, worker: _Worker) -> None:
        try:
            outcome, alive = _answer(worker)
        except BaseException as e:  # noqa: BLE001 - the call must end, whatever went wrong here
            outcome, alive = WorkerDied(f"the tool's worker could not be read: {_describe(e)}"), False
        self._finish(worker, outcome, alive)

    def _finish(self, worker: _Worker, outcome, alive: bool) -> None:
        future = worker.future
        with self._lock:
            self._busy.pop(id(future), None)
            worker.future = None
            if worker.ended or self._closed:   # killed as its answer came in, or the pool is closing
                alive = False
            if not alive:
                worker.retire()
            if not self._closed:
                if alive:
                    self._idle.append(worker)
                else:
                    self.replaced += 1
                self._refill()
                self._dispatch()
        try:
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        except InvalidStateError:
            pass


def _answer(worker: _Worker) -> tuple:
    """(what the call gave: its value or an exception, whether the worker can take another call)."""
    if worker.answered():
        try:
            status, value = worker.connection.recv()
        except (EOFError, OSError):
            pass   # it died: below
        except Exception as e:  # noqa: BLE001 - an answer that arrived whole but does not unpickle here
            return RuntimeError(f"the tool's result could not be read in the trainer: {_describe(e)}"), True
        else:
            return (value if status == "ok" else RuntimeError(value)), True
    # Its socket closed: it is ending by itself, and its exit code is its own, not the kill's.
    worker.exits_within(_GRACE_S)
    worker.end()   # what it left behind: a forked child still holding its socket, say
    return WorkerDied(f"the tool's worker process died (exit code {worker.process.wait()})"), False


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` ends (Linux 5.3 and later), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exited(pid: int) -> bool:
    """Whether child `pid` has ended, leaving it unreaped."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _describe(error: BaseException) -> str:
    """`Type: message`, or the type alone where str() fails (an exception's __str__ may raise too)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
