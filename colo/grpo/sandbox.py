"""Model-written Python, run where it cannot hurt the run: the sandbox behind the `python` tool
(`--tool colo.grpo.tools:python`).

Each program runs in a fresh interpreter (`python -I`), in a new session, with:

- an empty environment: none of the trainer's variables (tokens, credentials) is inherited;
- its own temporary directory as the working directory, deleted afterwards;
- limits: CPU seconds, address space, file size, open files (and processes, where the user is not root,
  for whom the kernel does not count them), and a wall-clock deadline after which its whole process
  group is killed; its output cut to a bound;
- an audit hook (PEP 578) installed before the program's first line, refusing what the program has no
  business doing: starting processes (fork, exec, subprocess, os.system), signalling any process,
  sockets, loading native code through ctypes, writing anywhere but its directory, and reading files
  outside its directory, Python's own installation and a few system paths (so not /proc/PID/environ of
  the trainer, nor the user's home);
- no network at all where the machine allows a network namespace (`unshare --net`, as root or with user
  namespaces); where it does not, only the audit hook stands in the way, and `network_isolated()` says
  so (and the first run logs it).

An audit hook is not a kernel boundary (a bug in a C extension could step around it): the empty
environment, the limits, the process group and the network namespace are the parts that hold whatever
the program does.
"""
from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WALL_SECONDS = 10.0
CPU_SECONDS = 5
MEMORY_BYTES = 1 << 30
FILE_BYTES = 16 << 20
OPEN_FILES = 64
PROCESSES = 32
OUTPUT_CHARS = 4000

# Run before the program: the audit hook, then the program itself from snippet.py (its own directory).
_BOOTSTRAP = r'''
import os, sys
_here = os.path.realpath(os.getcwd())
_readable = tuple(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p) + (
    _here, "/usr/lib", "/usr/share/zoneinfo", "/etc/localtime", "/dev/null", "/dev/urandom", "/proc/self",
    "/sys/devices/system/cpu")
_refused = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
            "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.socketpair", "ctypes.dlopen",
            "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "_posixsubprocess.fork_exec", "pty.spawn")
_writes = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
           "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")

def _inside(path, roots):
    try:
        path = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

def _hook(event, args):
    if event in _refused or event.startswith("os.exec"):
        raise PermissionError(f"the sandbox does not allow {event}")
    if event == "open":
        path, mode = args[0], args[1]
        if isinstance(path, int):
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(args[2] if len(args) > 2 else 0, int) and (args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        if writing and not _inside(path, (_here,)):
            raise PermissionError(f"the sandbox writes only inside its directory, not {path}")
        if not writing and not _inside(path, _readable):
            raise PermissionError(f"the sandbox does not read {path}")
    elif event in _writes:
        for path in args:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path, (_here,)):
                raise PermissionError(f"the sandbox does not allow {event} outside its directory ({path})")

sys.addaudithook(_hook)
del _hook
with open("snippet.py") as _f:
    _source = _f.read()
_globals = {"__name__": "__main__"}
exec(compile(_source, "snippet.py", "exec"), _globals)
'''


@dataclass
class SandboxResult:
    output: str          # stdout then stderr, cut to OUTPUT_CHARS
    exit_code: int | None
    killed: str = ""     # why it was stopped ("wall clock", "CPU time", "file size"), "" if it ended itself

    @property
    def text(self) -> str:
        """What the model reads."""
        tail = f"\n[stopped: {self.killed} limit]" if self.killed else (
            f"\n[exit status {self.exit_code}]" if self.exit_code else "")
        return (self.output + tail).strip() or "(no output)"


@functools.lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether this machine gives a sandboxed program a network namespace of its own (no network)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    for flags in (["--net"], ["--net", "--map-root-user"]):
        try:
            if subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10).returncode == 0:
                _UNSHARE_FLAGS[:] = flags
                return True
        except (OSError, subprocess.SubprocessError):
            pass
    return False


_UNSHARE_FLAGS: list[str] = []


def _limits(cpu_seconds: int, memory_bytes: int) -> None:
    """In the child, before exec: the resource limits (a new session was made by Popen)."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
    if os.getuid() != 0:   # the kernel does not count root's processes
        resource.setrlimit(resource.RLIMIT_NPROC, (PROCESSES, PROCESSES))


def run_python(code: str, *, wall_seconds: float = WALL_SECONDS, cpu_seconds: int = CPU_SECONDS,
               memory_bytes: int = MEMORY_BYTES) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring); what it printed, and how it ended."""
    if not isinstance(code, str):
        return SandboxResult(f"code must be a string, got {type(code).__name__}", 1)
    isolated = network_isolated()
    if not isolated and not getattr(run_python, "_said", False):
        run_python._said = True
        logger.warning("colo.grpo.sandbox: this machine gives no network namespace (unshare --net refused); "
                       "sandboxed programs are kept off the network by the audit hook only")
    directory = tempfile.mkdtemp(prefix="colo-sandbox-")
    try:
        with open(os.path.join(directory, "snippet.py"), "w") as f:
            f.write(code)
        command = [sys.executable, "-I", "-c", _BOOTSTRAP]
        if isolated:
            command = [shutil.which("unshare"), *_UNSHARE_FLAGS, *command]
        out_path = os.path.join(directory, ".output")
        with open(out_path, "wb") as out:
            process = subprocess.Popen(command, cwd=directory, env={}, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=functools.partial(_limits, cpu_seconds, memory_bytes))
            killed = ""
            try:
                code_ = process.wait(timeout=wall_seconds)
            except subprocess.TimeoutExpired:
                killed = "wall clock"
                _kill_group(process)
                code_ = process.wait()
        if code_ in (-signal.SIGXCPU, -signal.SIGKILL) and not killed:
            killed = "CPU time"
        elif code_ == -signal.SIGXFSZ:
            killed = "file size"
        _kill_group(process)   # anything it left behind in its group
        with open(out_path, "rb") as f:
            output = f.read(OUTPUT_CHARS * 4).decode("utf-8", "replace")
        if len(output) > OUTPUT_CHARS:
            output = output[:OUTPUT_CHARS] + f"\n[output cut at {OUTPUT_CHARS} characters]"
        return SandboxResult(output, code_, killed)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _kill_group(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
