"""Check, from package metadata, that the vLLM releases pyproject.toml pins fit colo's own torch pin:
the same torch version, and for the GPU wheel the same CUDA major as the torch wheel pip installs.

    python buildtools/check_pins.py            # exit 0: compatible; 1: a conflict, printed

`pip install -e ".[gpu]"` cannot resolve when the gpu extra's vLLM wheel requires another torch than
colo pins (vllm 0.33.0 wants torch 2.14.0; colo is tested with torch 2.13.0). The GPU wheel is
never installed on CPU CI machines, so this reads its metadata for a Linux x86_64 wheel with
`pip install --dry-run --report` (no install), and compares requirement strings. Run by .ci/run.

The version is not all: a vLLM wheel is built for one CUDA major and its kernels load only with a
torch built for the same one, yet its `torch==2.13.0` is also satisfied by torch 2.13.0+cu126 (pip
ignores the local label). So the CUDA major each wheel is built for is read from its requirements
(nvidia-*-cu13 packages, [cu13] extras, cuda-toolkit==13.x), and compared: the GPU vLLM wheel against
PyPI's torch wheel, and against the torch installed in this Python when that is a CUDA build.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("cpu", "gpu")

# The environment whose wheels are read: requirements that do not apply there (other platforms,
# extras nobody installs) say nothing about the CUDA the wheel is built for.
LINUX_X86_64 = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64",
                "os_name": "posix", "python_version": "3.12", "python_full_version": "3.12.0",
                "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# Distributions whose version is the CUDA version they ship (cuda-toolkit==13.0.3 is CUDA 13).
# Other unsuffixed nvidia-* packages (nvidia-cudnn-frontend, ...) have versions of their own.
VERSIONED_AS_CUDA = ("cuda-toolkit", "cuda-bindings", "nvidia-cuda-runtime")
# Lower bounds and exact pins name the CUDA major; an upper bound (<14) names the next one.
_MAJOR_NAMING_OPERATORS = ("==", "===", "~=", ">=")


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


def applies_to_linux_wheel(requirement: Requirement) -> bool:
    """Whether pip installs this requirement with the wheel on Linux x86_64, no extras asked for."""
    return requirement.marker is None or requirement.marker.evaluate(dict(LINUX_X86_64))


def requirement_cuda_major(requirement: Requirement) -> int | None:
    """The CUDA major one requirement names: nvidia-cublas-cu12 -> 12, cupy-cuda12x -> 12,
    nvidia-cutlass-dsl[cu13] -> 13, cuda-toolkit[cudart]==13.0.3 -> 13; None when it names none."""
    suffix = re.search(r"[-_.]cu(?:da)?(\d+)x?$", requirement.name.lower())
    if suffix:
        return int(suffix.group(1))
    for extra in requirement.extras:
        match = re.fullmatch(r"cu(?:da)?(\d+)x?", extra.lower())
        if match:
            return int(match.group(1))
    if re.sub(r"[-_.]+", "-", requirement.name.lower()) in VERSIONED_AS_CUDA:
        for spec in requirement.specifier:
            if spec.operator in _MAJOR_NAMING_OPERATORS:
                return int(spec.version.split(".")[0])
    return None


def cuda_requirements(requires_dist: list[str]) -> dict[int, list[str]]:
    """Each CUDA major a wheel's Requires-Dist names on Linux x86_64, with the requirements naming it
    (markers left off)."""
    found: dict[int, list[str]] = {}
    for text in requires_dist:
        requirement = Requirement(text)
        major = requirement_cuda_major(requirement) if applies_to_linux_wheel(requirement) else None
        if major is not None:
            found.setdefault(major, []).append(text.split(";")[0].strip())
    return found


def cuda_major(requires_dist: list[str]) -> int | None:
    """The CUDA major a wheel is built for, from its Requires-Dist; None when it requires no CUDA."""
    found = cuda_requirements(requires_dist)
    if len(found) > 1:
        named = " and ".join(f"CUDA {major} ({', '.join(texts)})" for major, texts in sorted(found.items()))
        raise ValueError(f"its requirements name several CUDA majors: {named}")
    return next(iter(found), None)


def _evidence(requires_dist: list[str], major: int, shown: int = 3) -> str:
    texts = cuda_requirements(requires_dist)[major]
    return ", ".join(texts[:shown]) + (f", and {len(texts) - shown} more" if len(texts) > shown else "")


def cuda_conflicts(engines: dict[str, list[str]], torch_name: str, torch_requires: list[str]) -> list[str]:
    """One message per vLLM wheel built for another CUDA major than PyPI's torch wheel (torch_name)."""
    out = []
    try:
        torch_major = cuda_major(torch_requires)
    except ValueError as error:
        return [f"PyPI's {torch_name} for Linux: {error}"]
    for name, requires in engines.items():
        try:
            engine_major = cuda_major(requires)
        except ValueError as error:
            out.append(f"{name}: {error}")
            continue
        if engine_major is None or engine_major == torch_major:
            continue
        torch_says = (f"CUDA {torch_major} ({_evidence(torch_requires, torch_major)})" if torch_major is not None
                      else "no CUDA (its requirements name no CUDA package)")
        out.append(f"{name} is built for CUDA {engine_major} ({_evidence(requires, engine_major)}), but PyPI's "
                   f"{torch_name} for Linux is built for {torch_says}: vLLM's kernels would not load with that torch")
    return out


def installed_torch_mismatch(torch_version: str, torch_cuda: str | None, engine: str, engine_major: int,
                             pypi_torch_major: int | None = None, engine_installed: bool = False) -> str | None:
    """A fix-it message when an installed torch (torch.__version__, torch.version.cuda such as "12.6")
    is built for another CUDA major than the vLLM wheel `engine` ("vllm==0.32.0"), or is a CPU build
    (torch_cuda None) while that vLLM is the one installed here (engine_installed); else None."""
    base = torch_version.split("+")[0]
    if pypi_torch_major == engine_major:  # === takes PyPI's wheel, never a local build (+cpu, +cu126)
        get_torch = (f"`pip uninstall -y torch && pip install 'torch==={base}'` "
                     f"(PyPI's Linux wheel of torch {base} is built for CUDA {engine_major})")
    else:
        get_torch = f"install a torch {base} built for CUDA {engine_major}"
    if torch_cuda is None:
        if not engine_installed:
            return None
        return (f"the installed torch {torch_version} is a CPU build, but the installed {engine} is built for CUDA "
                f"{engine_major}: vLLM's kernels will not load with this torch. pip accepts the pair because "
                f"{engine}'s torch=={base} ignores the local label of {torch_version}. Fix: {get_torch}.")
    torch_major = int(torch_cuda.split(".")[0])
    if torch_major == engine_major:
        return None
    return (f"the installed torch {torch_version} is built for CUDA {torch_cuda} (CUDA {torch_major}), but {engine} "
            f"is built for CUDA {engine_major}: vLLM's kernels will not load with this torch. pip accepts the pair "
            f"because {engine}'s torch=={base} ignores the local label of {torch_version}. Fix: {get_torch}, or "
            f"install a {engine} built for CUDA {torch_major}.")


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


def _installed_torch():
    """The torch installed in this Python (read from torch/version.py, not imported), or None."""
    spec = importlib.util.spec_from_file_location("colo_cmake_build", ROOT / "buildtools" / "cmake_build.py")
    cmake_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cmake_build)
    return cmake_build.installed_torch(cmake_build.python_site_dirs())


def _describe_cuda(requires_dist: list[str]) -> str:
    try:
        major = cuda_major(requires_dist)
    except ValueError as error:
        return str(error)
    return "no CUDA requirement" if major is None else f"CUDA {major} ({_evidence(requires_dist, major)})"


def main() -> int:
    torch_pin, engines = pins(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    metadata = dict(wheel_metadata(requirement) for requirement in engines.values())
    problems = conflicts(torch_pin, metadata)
    for name, requires in metadata.items():
        print(f"{name}: torch=={required_torch(requires)} (colo pins torch=={torch_pin})")

    # === matches 2.13.0 and not 2.13.0+cpu: the default wheel, not a local build a find-links dir offers.
    torch_name, torch_requires = wheel_metadata(f"torch==={torch_pin}")
    for name, requires in {**metadata, f"{torch_name} (PyPI, Linux x86_64)": torch_requires}.items():
        print(f"{name}: {_describe_cuda(requires)}")
    problems += cuda_conflicts(metadata, torch_name, torch_requires)

    installed = _installed_torch()
    mismatches = []
    if installed is None:
        print("installed torch: none in this Python")
    else:
        print(f"installed torch {installed.version}: " + (f"CUDA {installed.cuda}" if installed.cuda else "a CPU build"))
        pypi_torch_major = _major_or_none(torch_requires)
        for name, requires in metadata.items():
            engine_major = _major_or_none(requires)
            if engine_major is not None:
                mismatch = installed_torch_mismatch(installed.version, installed.cuda, name, engine_major, pypi_torch_major,
                                                    engine_installed=_is_installed(name))
                mismatches += [mismatch] if mismatch else []

    for problem in problems:
        print(f"pin conflict: {problem}", file=sys.stderr)
    for mismatch in mismatches:
        print(f"CUDA mismatch: {mismatch}", file=sys.stderr)
    return 1 if problems or mismatches else 0


def _is_installed(requirement: str) -> bool:
    """Whether this Python has exactly `requirement` ("vllm==0.32.0") installed."""
    from importlib import metadata

    name, _, version = requirement.partition("==")
    try:
        return metadata.version(name) == version
    except metadata.PackageNotFoundError:
        return False


def _major_or_none(requires_dist: list[str]) -> int | None:
    """cuda_major, with several majors counted as unknown (cuda_conflicts reports those)."""
    try:
        return cuda_major(requires_dist)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
