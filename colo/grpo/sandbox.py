"""Model-written Python, run where it cannot hurt the run: the sandbox behind the `python` tool
(`--tool colo.grpo.tools:python`).

Each program runs in a fresh interpreter (`python -I` running this file), in a session of its own, with
an empty environment (none of the trainer's variables: tokens, credentials), its own temporary directory
as the working directory (deleted afterwards), limits (CPU seconds, address space, file size, open files,
processes), a wall-clock deadline, and its output cut to a bound (written outside its directory). When
the run ends, by itself or at the deadline, every process it started is killed: its session's, and under
a root trainer whatever carries its uid, in any session. Its main process dies with the process that
started it; if that one is killed mid-run (a tool worker past its deadline), `end_sandboxes(pid)` does
the rest.

Before the program's first line, its process confines itself. What the kernel enforces, nothing the
program does afterwards can undo:

- network: a network namespace of its own, with no interface but loopback, where the machine allows one
  (a root trainer's sandbox makes it itself, before dropping root; otherwise `unshare --net
  --map-root-user`). `network_isolated()` says whether it does. Landlock ABI 4 also refuses TCP.
- privileges: under a root trainer, the program drops to a uid and gid of its own, one per run, with no
  supplementary groups and no capabilities, once its namespaces are made. It cannot enter the trainer's
  network namespace again, signal or trace the trainer, or write what only root may; the process limit
  counts its processes alone. Directories on the way to Python's installation that such a uid may not
  enter (a pyenv under /root, which is 0700) are covered, in a mount namespace of the program's own, by
  a tmpfs that holds only the paths it needs, bound from the real ones. `privileges_dropped()` says
  whether this works here (it is tried once); where it does not, programs run as root, and the first run
  logs that. A trainer that is not root runs programs as its own user: the process limit counts that
  user's processes, and a process that leaves the program's session is not found at the end.
- filesystem: Landlock (Linux 5.13 and later): the program reads and executes only Python's installation
  and a few system paths (`SYSTEM_READABLE`), and writes only in its directory, whatever the path it
  names (relative to a directory descriptor, through a link). From ABI 3 it cannot truncate a file
  outside its directory either, and from ABI 6 it cannot signal a process outside its sandbox.
  `landlock_abi()` says which ABI this kernel has (0: none).

An audit hook (PEP 578), installed last, is the first line: it refuses what the program has no business
doing (starting processes, signalling any process, sockets, native code through ctypes, writing outside
its directory, truncating included, and reading outside the readable paths) with a message that says so.
It keeps its state in a closure, out of reach of a program that rebinds module globals, but it is no
boundary: Python code can reach around it.

Where the kernel lacks a feature, what that feature holds rests on the hook alone, and the first run logs
each missing one: no network namespace, no Landlock (then, under a root trainer, the program's own uid
still keeps it from writing root's files), or no drop of root.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import itertools
import json
import logging
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WALL_SECONDS = 10.0
CPU_SECONDS = 5
MEMORY_BYTES = 1 << 30
FILE_BYTES = 16 << 20
OPEN_FILES = 64
PROCESSES = 32
OUTPUT_CHARS = 4000
# What a program may read besides Python's own installation (its prefixes and sys.path).
SYSTEM_READABLE = ("/usr/lib", "/usr/share/zoneinfo", "/etc/localtime", "/etc/ld.so.cache", "/dev/null",
                   "/dev/urandom", "/proc/self", "/sys/devices/system/cpu")

# A root trainer's sandboxes run as uids of their own, 16 for each process that starts them, from its
# pid: so the uids of a killed tool worker's sandboxes are known without asking it. With pids below 2**22
# the range stays within one systemd leaves unallocated (above its container ranges).
_UID_BASE = 0x70000000
_UIDS_PER_PROCESS = 16
_AUDIT_HOOK = True      # tests turn it off, to see what the kernel alone holds
_SETUP_FAILED = 125     # the child's exit status when it could not confine itself (the program never ran)
_runs = itertools.count()

_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_RULESET_VERSION, _RULE_PATH_BENEATH = 1, 1
# Landlock's filesystem rights: EXECUTE to MAKE_SYM (bits 0-12) in ABI 1, REFER in 2, TRUNCATE in 3,
# IOCTL_DEV in 5.
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV   # those a file (not a directory) takes
_NET_TCP = (1 << 0) | (1 << 1)     # bind and connect (ABI 4)
_SCOPES = (1 << 0) | (1 << 1)      # abstract unix sockets and signals (ABI 6)


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


def run_python(code: str, *, wall_seconds: float = WALL_SECONDS, cpu_seconds: int = CPU_SECONDS,
               memory_bytes: int = MEMORY_BYTES) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring); what it printed, and how it ended."""
    if not isinstance(code, str):
        return SandboxResult(f"code must be a string, got {type(code).__name__}", 1)
    _say_what_is_missing()
    return _run(code, wall_seconds, cpu_seconds, memory_bytes, drop=privileges_dropped())


@functools.lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether this machine gives a sandboxed program a network namespace of its own (no network)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    for flags in (["--net"], ["--net", "--map-root-user"]):
        try:
            if subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10, check=False).returncode == 0:
                _UNSHARE_FLAGS[:] = flags
                return True
        except (OSError, subprocess.SubprocessError):
            pass
    return False


_UNSHARE_FLAGS: list[str] = []


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    """The Landlock ABI version of this kernel; 0 where it has none (before Linux 5.13, or not enabled)."""
    try:
        return _call("syscall", _SYS_CREATE_RULESET, None, 0, _RULESET_VERSION)
    except (OSError, AttributeError):
        return 0


@functools.lru_cache(maxsize=1)
def privileges_dropped() -> bool:
    """Whether sandboxed programs run as a uid of their own: under a root trainer, where this machine lets
    them (tried once: a container may refuse the namespaces, or map no such uid). A trainer that is not
    root runs them as its own user."""
    if os.getuid() != 0:
        return False
    # A module nothing has imported yet: the uid must read Python's installation, not only run.
    probe = _run("import fractions, os; print(os.getuid())", WALL_SECONDS, CPU_SECONDS, MEMORY_BYTES, drop=True)
    if probe.exit_code == 0 and probe.output.strip() not in ("", "0"):
        return True
    logger.warning("colo.grpo.sandbox: sandboxed programs cannot drop root here (%s); they run as root, held "
                   "by Landlock where the kernel has it and by the audit hook", probe.text[-500:])
    return False


def end_sandboxes(owner: int) -> None:
    """Kill what is left of the sandboxes process `owner` started, and remove their directories: for a tool
    worker killed mid-run, whose own clean-up never ran. Their processes are found by their uids, so only
    under a root trainer; otherwise the caller ends their sessions (colo.grpo.tool_workers)."""
    first = _UID_BASE + owner * _UIDS_PER_PROCESS
    if os.getuid() == 0:
        kill_processes(lambda p: any(first <= uid < first + _UIDS_PER_PROCESS for uid in p.uids))
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), f"colo-sandbox-{owner}-*")):
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Process:
    pid: int
    ppid: int
    session: int

    @functools.cached_property
    def uids(self) -> set[int]:
        """Its real, effective, saved and filesystem uids (none once it has ended)."""
        try:
            with open(f"/proc/{self.pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        return {int(uid) for uid in line.split()[1:]}
        except OSError:
            pass
        return set()


def processes():
    """The live processes, from /proc (zombies left out: they hold nothing and cannot be killed again)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                line = f.read()
        except OSError:   # it ended meanwhile
            continue
        fields = line[line.rindex(b")") + 2:].split()   # after "pid (command) ", which may hold spaces
        if fields[0] not in (b"Z", b"X"):
            yield Process(int(name), int(fields[1]), int(fields[3]))


def kill_processes(match) -> None:
    """SIGKILL every process `match` accepts, until none is left: what one forks meanwhile is found on the
    next pass. One stuck in the kernel (state D) may outlast the passes."""
    me = os.getpid()
    for _ in range(100):
        found = [p.pid for p in processes() if p.pid != me and match(p)]
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _run(code: str, wall_seconds: float, cpu_seconds: int, memory_bytes: int, drop: bool) -> SandboxResult:
    uid = _UID_BASE + os.getpid() * _UIDS_PER_PROCESS + next(_runs) % _UIDS_PER_PROCESS if drop else None
    # Named for the process that runs it, so that end_sandboxes finds it if that process is killed.
    directory = tempfile.mkdtemp(prefix=f"colo-sandbox-{os.getpid()}-")
    try:
        snippet = os.path.join(directory, "snippet.py")
        with open(snippet, "w") as f:
            f.write(code)
        if uid is not None:   # its only writable place
            os.chown(directory, uid, uid)
            os.chown(snippet, uid, uid)
        config = {"uid": uid, "network": network_isolated() and os.getuid() == 0, "landlock": landlock_abi(),
                  "readable": list(SYSTEM_READABLE), "cpu": cpu_seconds, "memory": memory_bytes,
                  "hook": _AUDIT_HOOK}
        # The output goes to a file outside its directory: the program cannot swap it for a link to
        # something only the trainer may read.
        with tempfile.TemporaryFile() as out:
            process = subprocess.Popen(_command(config), cwd=directory, env={}, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                killed = "" if _ended(process.pid, wall_seconds) else "wall clock"
            finally:
                # Before it is waited for: until then its pid, hence its session, is still its own.
                kill_processes(lambda p: p.session == process.pid or (uid is not None and uid in p.uids))
                code_ = process.wait()
            out.seek(0)
            output = out.read(OUTPUT_CHARS * 4).decode("utf-8", "replace")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if code_ in (-signal.SIGXCPU, -signal.SIGKILL) and not killed:
        killed = "CPU time"
    elif code_ == -signal.SIGXFSZ:
        killed = "file size"
    if len(output) > OUTPUT_CHARS:
        output = output[:OUTPUT_CHARS] + f"\n[output cut at {OUTPUT_CHARS} characters]"
    return SandboxResult(output, code_, killed)


def _command(config: dict) -> list[str]:
    command = [sys.executable, "-I", "-B", os.path.abspath(__file__), json.dumps(config)]
    if network_isolated() and os.getuid() != 0:   # as root the program makes its own (then drops root)
        command = [shutil.which("unshare"), *_UNSHARE_FLAGS, *command]
    return command


def _ended(pid: int, timeout: float) -> bool:
    """Whether child `pid` ended within `timeout` seconds; left unreaped, so its pid still names it."""
    deadline, delay = time.monotonic() + timeout, 0.0005
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)


_said = False


def _say_what_is_missing() -> None:
    """Once per process: which of the kernel's boundaries this machine lacks (the hook stands in)."""
    global _said
    if _said:
        return
    _said = True
    if not network_isolated():
        logger.warning("colo.grpo.sandbox: this machine gives no network namespace (unshare --net refused); "
                       "sandboxed programs are kept off the network by the audit hook only")
    if not landlock_abi():
        logger.warning("colo.grpo.sandbox: this kernel has no Landlock; what sandboxed programs read and write "
                       "is limited by the audit hook only%s",
                       " (and their own uid's permissions)" if privileges_dropped() else "")


# In the sandbox's own process (this file run as a script), before the program's first line.

def _child(config: dict) -> None:
    """Confine this process for good, then run the program; if it cannot be confined, the program never runs."""
    try:
        with open("snippet.py") as f:
            source = f.read()
        _confine(config)
    except Exception as e:  # noqa: BLE001 - any failure: the program must not run unconfined
        print(f"the sandbox could not be set up: {e}", file=sys.stderr, flush=True)
        os._exit(_SETUP_FAILED)
    _run_program(source)


def _confine(config: dict) -> None:
    here = os.path.realpath(os.getcwd())
    readable = _readable(config["readable"])
    uid = config["uid"]
    hidden = _hidden([*readable, here]) if uid is not None else {}
    flags = (_CLONE_NEWNET if config["network"] else 0) | (_CLONE_NEWNS if hidden else 0)
    if flags:   # as root, while it still may
        _call("unshare", flags)
    _expose(hidden)
    _limits(config["cpu"], config["memory"])
    if uid is not None:
        # The kernel clears every capability when root's uid goes: no setns back, no signals to root.
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _call("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)   # what Landlock needs without privileges
    _call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)   # it dies with the process that started it
    if config["landlock"]:
        _landlock(config["landlock"], readable, here)
    sys.dont_write_bytecode = True
    if config["hook"]:
        sys.addaudithook(_audit_hook(here, (*readable, here)))


def _readable(system: list) -> list[str]:
    paths = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path, *system)
    return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})


def _hidden(paths: list[str]) -> dict[str, list[str]]:
    """The topmost directory on each path that a uid of no group of its own may not enter, with the paths
    beneath it."""
    plan: dict[str, list[str]] = {}
    for path in paths:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                plan.setdefault(ancestor, []).append(path)
                break
    return plan


def _expose(plan: dict[str, list[str]]) -> None:
    """In the program's own mount namespace: an empty tmpfs over each hidden directory, holding only the
    paths beneath it the program needs, bound from the real ones."""
    if not plan:
        return
    _call("mount", None, b"/", None, _MS_REC | _MS_PRIVATE, None)   # nothing done here reaches the trainer
    for hidden, paths in plan.items():
        outermost = [p for p in paths if not any(p.startswith(q + "/") for q in paths)]   # a bind brings its inside
        handles = [(path, os.open(path, os.O_PATH)) for path in outermost]   # before the tmpfs covers them
        _call("mount", b"tmpfs", hidden.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0711")
        for path, fd in handles:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "a").close()
            _call("mount", f"/proc/self/fd/{fd}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None)
            os.close(fd)


def _limits(cpu_seconds: int, memory_bytes: int) -> None:
    # Soft and hard alike: without privileges a limit can be lowered, never raised again.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
    # Counted per real uid, and not at all for root: it bounds a program that dropped root to its own
    # processes; a trainer that is not root shares it with the program.
    resource.setrlimit(resource.RLIMIT_NPROC, (PROCESSES, PROCESSES))


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1   # the kernel's struct is packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(abi: int, readable: list[str], here: str) -> None:
    """Reading and executing `readable`, anything in `here`, nothing else; no TCP (ABI 4); no signals or
    abstract unix sockets beyond the sandbox (ABI 6)."""
    handled = (1 << 13) - 1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0) | (
        _IOCTL_DEV if abi >= 5 else 0)
    attr = _RulesetAttr(handled, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24   # the fields this ABI knows
    ruleset = _call("syscall", _SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    try:
        for path in readable:
            _allow(ruleset, path, _EXECUTE | _READ_FILE | _READ_DIR)
        _allow(ruleset, "/dev/null", (_READ_FILE | _WRITE_FILE | _TRUNCATE) & handled)
        _allow(ruleset, here, handled)
        _call("syscall", _SYS_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)


def _allow(ruleset: int, path: str, rights: int) -> None:
    fd = os.open(path, os.O_PATH)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FILE_RIGHTS
        _call("syscall", _SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(_PathBeneathAttr(rights, fd)), 0)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _call(name: str, *args) -> int:
    """A libc function, integers passed as C longs (a syscall reads whole registers); OSError if it fails."""
    result = getattr(_libc(), name)(*(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")
    return result


def _audit_hook(here: str, readable: tuple):
    """The first line (see the module docstring). Its state lives in this closure, not in globals a program
    could rebind; gc's object walks, which would reach it, are refused."""
    refused = frozenset((
        "os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.kill",
        "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.socketpair", "ctypes.dlopen", "ctypes.dlsym",
        "ctypes.call_function", "ctypes.cdata", "_posixsubprocess.fork_exec", "pty.spawn", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents"))
    writes = frozenset((
        "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
        "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"))
    # Anything but plain reading: O_RDONLY | O_TRUNC empties a file too.
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, fsdecode = os.path.realpath, os.fsdecode

    def inside(path, roots) -> bool:
        try:
            path = realpath(fsdecode(path))
        except (TypeError, ValueError):
            return False
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event, args):
        if event in refused or event.startswith("os.exec"):
            raise PermissionError(f"the sandbox does not allow {event}")
        if event == "open":
            path, mode, flags = args[0], args[1], args[2] if len(args) > 2 else 0
            if isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path, (here,)):
                raise PermissionError(f"the sandbox writes only inside its directory, not {path}")
            if not writing and not inside(path, readable):
                raise PermissionError(f"the sandbox does not read {path}")
        elif event in writes:
            for path in args:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, (here,)):
                    raise PermissionError(f"the sandbox does not allow {event} outside its directory ({path})")

    return hook


def _run_program(source: str) -> None:
    """The program, as a __main__ module of its own (not this file's, which holds the set-up)."""
    module = types.ModuleType("__main__")
    module.__file__ = "snippet.py"
    sys.modules["__main__"] = module
    sys.argv = ["snippet.py"]
    try:
        exec(compile(source, "snippet.py", "exec"), module.__dict__)  # noqa: S102 - running it is the point
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the program's error, shown from its own frames
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
