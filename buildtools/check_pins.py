"""Check that the vLLM releases pyproject.toml pins accept colo's own torch pin, from package metadata.

    python buildtools/check_pins.py            # exit 0: compatible; 1: a conflict, printed

`pip install -e ".[gpu]"` cannot resolve when the gpu extra's vLLM wheel requires another torch than
colo pins (vllm 0.33.0 wants torch 2.14.0; colo is tested with torch 2.13.0). The GPU wheel is
never installed on CPU CI machines, so this reads its metadata for a Linux x86_64 wheel with
`pip install --dry-run --report` (no install), and compares requirement strings. Run by .ci/run.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("cpu", "gpu")


def pins(pyproject: dict) -> tuple[str, dict[str, str]]:
    """colo's torch pin ("2.13.0") and, per extra, the exact vLLM requirement it names."""
    torch = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    extras = pyproject["project"]["optional-dependencies"]
    engines = {extra: next(d for d in extras[extra] if d.startswith("vllm")) for extra in EXTRAS}
    return torch.split("==", 1)[1], engines


def required_torch(requires_dist: list[str]) -> str | None:
    """The torch version a wheel pins exactly (None when it pins none)."""
    for requirement in requires_dist:
        match = re.fullmatch(r"torch\s*==\s*([^\s;,]+)", requirement.split(";")[0].strip())
        if match:
            return match.group(1)
    return None


def conflicts(torch_pin: str, metadata: dict[str, list[str]]) -> list[str]:
    """One message per vLLM distribution whose torch pin is not colo's."""
    out = []
    for name, requires in metadata.items():
        wanted = required_torch(requires)
        if wanted is not None and wanted.split("+")[0] != torch_pin:
            out.append(f"{name} requires torch=={wanted}, but colo pins torch=={torch_pin}")
    return out


def wheel_metadata(requirement: str) -> tuple[str, list[str]]:
    """(name==version, Requires-Dist) of the wheel pip would pick for Linux x86_64, Python 3.12."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--no-deps",
                        "--ignore-installed", "--report", str(report), "--platform", "manylinux_2_28_x86_64",
                        "--python-version", "3.12", "--only-binary=:all:", "--target", str(Path(tmp) / "t"),
                        requirement], check=True)
        item = json.loads(report.read_text())["install"][0]["metadata"]
    return f"{item['name']}=={item['version']}", item.get("requires_dist", [])


def main() -> int:
    torch_pin, engines = pins(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    metadata = dict(wheel_metadata(requirement) for requirement in engines.values())
    problems = conflicts(torch_pin, metadata)
    for name, requires in metadata.items():
        print(f"{name}: torch=={required_torch(requires)} (colo pins torch=={torch_pin})")
    for problem in problems:
        print(f"pin conflict: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
