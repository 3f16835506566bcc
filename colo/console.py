"""A command's own lines on the terminal, everything else in a log file.

vLLM, torch, transformers and the C++ libraries below them write warnings, progress bars and reports to
file descriptors 1 and 2 (a vLLM engine's start-up alone is a hundred lines; at interpreter exit
Triton's nanobind prints a leak report). `python -m colo.grpo` and `python -m colo.bench` send all of it
to a log file and print their own lines, colo's warnings among them, on streams kept on the terminal:

    logs = LogsToFile(out / "logs.txt")        # None: nothing redirected (--show-logs)
    with logs:
        print("colo.grpo: ...", file=logs.out)  # the terminal; anything else goes to the file
    logs.keep_until_exit()                      # what the interpreter prints at exit goes to the file too
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path


def _terminal(stream):
    """A stream writing where `stream` writes now, whatever file descriptor 1 or 2 is later pointed at (a
    stream with no file descriptor, such as pytest's capture, is itself)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return stream
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                     errors="backslashreplace")


class LogsToFile:
    """While active, this process's stdout and stderr (file descriptors 1 and 2: vLLM's and torch's logs,
    C++ warnings, child processes', and Python's sys.stdout and sys.stderr) go to `path`, appended; `out`
    and `err` stay on the terminal, for the command's own lines, and so do colo's warnings (the "colo"
    logger) unless `colo_warnings` is False. `path` None: nothing is redirected (--show-logs). Re-entered
    as often as needed."""

    def __init__(self, path: Path | None, colo_warnings: bool = True, create: bool = True):
        """create=False: where `path`'s directory does not exist yet, the output goes to a temporary file
        until `settle()` (a command that refuses its arguments leaves no directory behind)."""
        self.path, self.colo_warnings = path, colo_warnings
        self.out, self.err = sys.stdout, sys.stderr
        self._writing_to = path
        if path is not None:
            if create:
                path.parent.mkdir(parents=True, exist_ok=True)
            if not path.parent.is_dir():
                fd, name = tempfile.mkstemp(prefix="colo-logs-", suffix=".txt")
                os.close(fd)
                self._writing_to = Path(name)
            os.close(os.open(self._writing_to, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))   # writable: said here
            self.out, self.err = _terminal(sys.stdout), _terminal(sys.stderr)
        self._saved: tuple[int, int] | None = None
        self._handler = logging.StreamHandler(self.err)
        self._handler.setLevel(logging.WARNING)

    def __enter__(self):
        if self.path is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            self._saved = (os.dup(1), os.dup(2))
            self._point_at_file()
            if self.colo_warnings:
                logging.getLogger("colo").addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            logging.getLogger("colo").removeHandler(self._handler)
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, saved in zip((1, 2), self._saved):
                os.dup2(saved, fd)
                os.close(saved)
            self._saved = None
        return False

    def settle(self) -> None:
        """Once `path`'s directory exists: what went to the temporary file so far is appended to `path`, and
        the output goes there from now on."""
        if self.path is None or self._writing_to == self.path:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        with open(self._writing_to, "rb") as written, open(self.path, "ab") as log:
            shutil.copyfileobj(written, log)
        os.unlink(self._writing_to)
        self._writing_to = self.path
        if self._saved is not None:
            self._point_at_file()

    def keep_until_exit(self) -> None:
        """Point file descriptors 1 and 2 at the file for the rest of the process, after the command's last
        line: what libraries print while the interpreter exits lands there, not under that line (a
        temporary file no directory took is removed, its output going nowhere)."""
        if self.path is not None:
            self.out.flush()
            self.err.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            self._point_at_file()
            if self._writing_to != self.path:
                os.unlink(self._writing_to)

    def _point_at_file(self) -> None:
        log = os.open(self._writing_to, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
