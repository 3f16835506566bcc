"""SIGTERM as a request to stop after the current step (the run checkpoints it and raises
colo.errors.Terminated), instead of dying mid-step with the work since the last checkpoint lost."""
from __future__ import annotations

import signal
import threading


class TerminationRequest:
    """Installs a SIGTERM handler that sets `requested` (main thread only; elsewhere a no-op) until restore()."""

    def __init__(self):
        self.requested = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum, frame):
        self.requested = True

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
