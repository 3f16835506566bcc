"""Directories written whole or not at all."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path


@contextlib.contextmanager
def staged_directory(directory: str | Path):
    """Yield DIR.writing to fill; on success it replaces DIR, on an error it is removed and DIR (if any)
    stays as it was, so the name never holds a half-written directory."""
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".writing")
    old = directory.with_name(directory.name + ".old")
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if directory.exists():
        directory.rename(old)
    staging.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
