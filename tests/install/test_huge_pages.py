"""`import colo` before torch puts torch's CPU tensors of 2 MiB and more on transparent huge pages
(torch's THP_MEM_ALLOC_ENABLE: torch advises the kernel, MADV_HUGEPAGE, which /proc/self/smaps shows as
the mapping's `hg` flag), keeps a value the user set, and sets nothing once torch is imported (torch has
read the variable by then). Each case in a fresh interpreter: the variable is read once."""
from __future__ import annotations

import os
import subprocess
import sys

SHOW = "import os; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
ADVISED = """
import torch
tensor = torch.ones(64 << 20, dtype=torch.uint8)  # (kept alive: its mapping stays)
ptr = tensor.data_ptr()
inside = False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and ":" not in head:
        low, high = (int(x, 16) for x in head.split("-"))
        inside = low <= ptr < high
    elif inside and line.startswith("VmFlags:"):
        print("hg" in line.split())
"""


def python(code: str, **env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True, timeout=300).stdout.split()


def test_colo_turns_huge_pages_on_for_torch_unless_told_or_too_late():
    assert python(f"import colo; {SHOW}\n{ADVISED}") == ["1", "True"]
    assert python(f"import colo; {SHOW}\n{ADVISED}", THP_MEM_ALLOC_ENABLE="0") == ["0", "False"]
    assert python(f"import torch, colo; {SHOW}") == ["None"]
