"""The `python` tool's sandbox (colo.grpo.sandbox): hostile programs end as results, the trainer unharmed,
nothing written outside the sandbox's directory; and with the audit hook switched off, the kernel alone
(Landlock, the program's own uid, its namespaces) still holds."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from colo.grpo import sandbox
from colo.grpo.sandbox import run_python
from colo.grpo.tools import python

HOSTILE = {
    "an endless loop": ("while True: pass", "CPU time limit"),
    "a memory hog": ("x = bytearray(10**10)", "MemoryError"),
    "a fork bomb": ("import os\nwhile True: os.fork()", "does not allow os.fork"),
    "signalling its parent": ("import os, signal; os.kill(os.getppid(), signal.SIGKILL)", "does not allow os.kill"),
    "a socket": ("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)", "does not allow socket"),
    "a subprocess": ("import subprocess; subprocess.run(['ls', '/'])", "does not allow subprocess.Popen"),
    "native code": ("import ctypes; ctypes.CDLL(None).system(b'true')", "does not allow ctypes.dlopen"),
    "the trainer's environment through /proc": (
        "import os; print(open(f'/proc/{os.getppid()}/environ').read())", "does not read /proc/"),
}

# What the audit found: the hook read its state from the globals of the bootstrap's module, __main__.
REBIND_THE_HOOK = """
import sys
m = sys.modules["__main__"]
m._refused = (); m._writes = (); m._inside = lambda path, roots: True
"""


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_hostile_program_ends_as_an_error_result(what, tmp_path):
    code, said = HOSTILE[what]
    started = time.perf_counter()
    result = run_python(code, wall_seconds=10, cpu_seconds=2)
    assert said in result.text, result.text
    assert time.perf_counter() - started < 10   # the CPU limit, not the wall clock, stopped the loop


def test_it_sees_none_of_the_trainers_variables_and_writes_only_its_own_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("COLO_PLANTED_SECRET", "hunter2")
    outside = tmp_path / "escaped.txt"
    assert "hunter2" not in run_python("import os; print(os.environ)").text
    result = run_python(f"open({str(outside)!r}, 'w').write('x')")
    assert "writes only inside its directory" in result.text and not outside.exists()
    inside = run_python("open('notes.txt', 'w').write('kept'); print(open('notes.txt').read())")
    assert inside.text == "kept" and inside.exit_code == 0
    # A fresh directory, and its output is not in it (a link there would make the trainer read for it).
    assert run_python("import os; print(os.listdir('.'))").text == "['snippet.py']"


def test_the_tool_returns_output_and_errors_as_text_cut_to_a_bound():
    assert python("print(sum(range(10)))") == "45"
    assert "ZeroDivisionError" in python("1 / 0") and "[exit status 1]" in python("1 / 0")
    assert python("print('x' * 100000)").endswith("[output cut at 4000 characters]")
    assert python("") == "(no output)"


def test_rebinding_the_bootstraps_globals_switches_nothing_off(tmp_path):
    outside = tmp_path / "escaped.txt"
    result = run_python(REBIND_THE_HOOK + f"open({str(outside)!r}, 'w').write('x')")
    assert "writes only inside its directory" in result.text and not outside.exists(), result.text


@pytest.fixture
def open_dir(monkeypatch):
    """A directory in /tmp any uid may write, holding a file any uid may write, which the sandbox may read:
    only Landlock (and the hook) keep a program from changing them."""
    directory = tempfile.mkdtemp(prefix="colo-sandbox-test-")
    try:
        os.chmod(directory, 0o777)
        victim = os.path.join(directory, "victim.txt")
        with open(victim, "w") as f:
            f.write("keep")
        os.chmod(victim, 0o666)
        monkeypatch.setattr(sandbox, "SYSTEM_READABLE", (*sandbox.SYSTEM_READABLE, victim))
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_the_hook_counts_truncation_as_writing(open_dir):
    victim = os.path.join(open_dir, "victim.txt")
    result = run_python(f"import os; os.open({victim!r}, os.O_RDONLY | os.O_TRUNC)")
    assert "writes only inside its directory" in result.text, result.text
    assert Path(victim).read_text() == "keep"


@pytest.fixture
def no_hook(monkeypatch):
    monkeypatch.setattr(sandbox, "_AUDIT_HOOK", False)


def needs(landlock: int = 0, own_uid: bool = False, network: bool = False) -> None:
    if sandbox.landlock_abi() < landlock:
        pytest.skip(f"this kernel has Landlock ABI {sandbox.landlock_abi()}, not {landlock}")
    if own_uid and not sandbox.privileges_dropped():
        pytest.skip("sandboxed programs do not run as a uid of their own here (the trainer is not root)")
    if network and not sandbox.network_isolated():
        pytest.skip("this machine gives no network namespace")


KERNEL_REFUSES = {   # {victim}, {outside}: the open directory's file and a path beside it
    "writing outside its directory": "open({outside!r}, 'w').write('x')",
    "truncating a file it may read": "import os; os.open({victim!r}, os.O_RDONLY | os.O_TRUNC)",
    "reading a file anyone may read": "print(open('/etc/passwd').read())",
    "writing through a directory fd": """import os
os.makedirs("a/b/c/d/e/f/g/h", exist_ok=True)
os.chdir("a/b/c/d/e/f/g/h")
fd = os.open("/usr/lib", os.O_RDONLY | os.O_DIRECTORY)
os.open("../.." + {outside!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd)""",
}


@pytest.mark.parametrize("what", list(KERNEL_REFUSES))
def test_without_the_hook_the_kernel_keeps_its_files_to_its_directory(what, open_dir, no_hook):
    needs(landlock=3)
    victim, outside = os.path.join(open_dir, "victim.txt"), os.path.join(open_dir, "escaped.txt")
    result = run_python(KERNEL_REFUSES[what].format(victim=victim, outside=outside))
    assert "PermissionError: [Errno 13]" in result.text, result.text
    assert sorted(os.listdir(open_dir)) == ["victim.txt"] and Path(victim).read_text() == "keep"


def test_without_the_hook_it_is_no_root_and_cannot_signal_the_trainer(no_hook):
    needs(own_uid=True)
    result = run_python("""import os
status = open('/proc/self/status').read()
print(os.getuid(), os.getgid(), os.getgroups(), status.split('CapEff:')[1].split()[0])
try:
    os.kill(os.getppid(), 0)
except PermissionError:
    print('no signals')""")
    uid, gid, groups, capabilities, said = result.output.split(maxsplit=4)
    assert int(uid) not in (0, os.getuid()) and gid == uid and groups == "[]", result.text
    assert int(capabilities, 16) == 0 and said.strip() == "no signals"


def test_without_the_hook_it_cannot_rejoin_the_trainers_network(no_hook):
    needs(own_uid=True, network=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    result = run_python(f"""import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
for pid in (os.getppid(), 1):
    try:
        print("setns", libc.setns(os.open(f"/proc/{{pid}}/ns/net", os.O_RDONLY), 0x40000000))
    except OSError as e:
        print("setns refused", e.errno)
socket.create_connection(("127.0.0.1", {port}), timeout=2)""")
    assert result.output.count("setns refused") == 2 and result.exit_code == 1, result.text
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def live_processes_of(uid: int) -> list[int]:
    return [p.pid for p in sandbox.processes() if uid in p.uids]


def test_a_fork_bomb_stops_at_the_process_limit_and_nothing_it_forked_survives(no_hook):
    needs(own_uid=True)
    result = run_python("""import os, time
print(os.getuid(), flush=True)
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print("stopped", n, e.errno)""")
    uid, said, forked, errno = result.output.split()
    assert said == "stopped" and int(forked) < sandbox.PROCESSES and int(errno) == 11, result.text
    assert live_processes_of(int(uid)) == []


def test_a_process_that_left_its_session_ends_with_the_run(no_hook):
    needs(own_uid=True)   # found by its uid: where the program keeps the trainer's, nothing finds it
    result = run_python("""import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        time.sleep(60)
    os._exit(0)
time.sleep(0.5)""")
    pid = int(result.output)
    assert pid not in [p.pid for p in sandbox.processes()], result.text


CALLER = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("colo_sandbox_alone", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
sandbox._AUDIT_HOOK = False
sandbox.run_python('''import os, time
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
time.sleep(60)''')
"""


def test_what_a_killed_caller_left_is_ended_and_its_directory_removed():
    """A tool worker killed at its deadline never runs run_python's clean-up: end_sandboxes does it."""
    caller = subprocess.Popen([sys.executable, "-c", CALLER, sandbox.__file__])
    pattern = os.path.join(tempfile.gettempdir(), f"colo-sandbox-{caller.pid}-")
    try:
        deadline = time.monotonic() + 30
        while not any(name.startswith(os.path.basename(pattern)) for name in os.listdir(tempfile.gettempdir())):
            assert time.monotonic() < deadline and caller.poll() is None, "the sandbox did not start"
            time.sleep(0.05)
        time.sleep(1.0)   # its program is running and has forked
    finally:
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
    sandbox.end_sandboxes(caller.pid)
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(os.path.basename(pattern))]
    if sandbox.privileges_dropped():
        first = sandbox._UID_BASE + caller.pid * sandbox._UIDS_PER_PROCESS
        assert not [p.pid for p in sandbox.processes() if any(first <= u < first + 16 for u in p.uids)]


def test_where_the_kernel_has_no_landlock_it_runs_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 0)
    monkeypatch.setattr(sandbox, "_said", False)
    with caplog.at_level(logging.WARNING, logger="colo.grpo.sandbox"):
        assert run_python("print(6 * 7)").text == "42"
        assert "writes only inside" in run_python("open('/tmp/x', 'w')").text
    assert sum("no Landlock" in r.getMessage() for r in caplog.records) == 1
