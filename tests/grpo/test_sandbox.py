"""The `python` tool's sandbox (colo.grpo.sandbox): hostile programs end as results, the trainer unharmed,
nothing written outside the sandbox's directory."""
from __future__ import annotations

import time

import pytest

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
    assert run_python("import os; print(os.listdir('.'))").text == "['snippet.py', '.output']"  # a fresh directory


def test_the_tool_returns_output_and_errors_as_text_cut_to_a_bound():
    assert python("print(sum(range(10)))") == "45"
    assert "ZeroDivisionError" in python("1 / 0") and "[exit status 1]" in python("1 / 0")
    assert python("print('x' * 100000)").endswith("[output cut at 4000 characters]")
    assert python("") == "(no output)"

