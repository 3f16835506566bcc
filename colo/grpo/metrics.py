"""What a GRPO run reports: a JSON-lines step log, a Chrome-trace/Perfetto timeline of the phases,
and GPU utilisation and memory from NVML when a GPU is present.

The timeline uses the Chrome trace "JSON array" form written one event per line: the closing
bracket is optional in that format, so a run killed mid-way still leaves a file that
chrome://tracing and ui.perfetto.dev open.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path


class StepLog:
    """One JSON object per line, one line per step. On resume, records past the checkpoint's step
    are dropped first, so the log of a killed-and-resumed run has each step exactly once."""

    def __init__(self, path: str | Path | None, resume_after_step: int | None = None):
        self.path = Path(path) if path else None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after_step is None:
            self.path.write_text("")
        else:
            self._truncate_after(resume_after_step)

    def _truncate_after(self, step: int) -> None:
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the half-written last line of a killed run
                if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                    kept.append(line)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, self.path)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


class Timeline:
    """Phase spans and memory counters in Chrome trace format; a no-op when path is None."""

    def __init__(self, path: str | Path | None, rank: int = 0, append: bool = False):
        self.rank = rank
        self._file = None
        self._origin = time.perf_counter()
        # Wall-clock origin, so spans of a resumed run land after those of the run it continues.
        self._origin_us = time.time() * 1e6
        if path is None:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not append or not path.exists() or path.stat().st_size == 0
        if not fresh:
            _reopen_array(path)
        self._file = open(path, "w" if fresh else "a")
        if fresh:
            self._file.write("[\n")
            self._emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                        "args": {"name": f"colo.grpo rank {rank}"}})

    def _now_us(self) -> float:
        return self._origin_us + (time.perf_counter() - self._origin) * 1e6

    def _emit(self, event: dict) -> None:
        self._file.write(json.dumps(event) + ",\n")
        self._file.flush()

    @contextlib.contextmanager
    def span(self, name: str, **args):
        """Time a phase; yields a dict whose 'seconds' is filled in when the block ends."""
        result = {"seconds": 0.0}
        start = time.perf_counter()
        start_us = self._now_us()
        try:
            yield result
        finally:
            result["seconds"] = time.perf_counter() - start
            if self._file is not None:
                self._emit({"name": name, "ph": "X", "pid": self.rank, "tid": 0, "ts": start_us,
                            "dur": result["seconds"] * 1e6, "args": args})

    def counter(self, name: str, values: dict) -> None:
        if self._file is not None:
            self._emit({"name": name, "ph": "C", "pid": self.rank, "ts": self._now_us(), "args": values})

    def close(self) -> None:
        """End the array, so strict JSON readers accept the file too."""
        if self._file is not None:
            self._file.write(json.dumps({"name": "trace_end", "ph": "i", "s": "g", "pid": self.rank, "tid": 0,
                                         "ts": self._now_us()}) + "\n]\n")
            self._file.close()
            self._file = None


def rank_path(path, rank: int):
    """A rank's own file of a per-run path: the path itself on rank 0, `name.rankR.ext` on the others."""
    if path is None or rank == 0:
        return path
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class ProgressBar:
    """tqdm's bar over a run's steps with the last reward and step time; a no-op when not enabled."""

    def __init__(self, steps: int, done: int, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=done, desc="colo.grpo", unit="step", dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{record['reward_mean']:.3f}", step_s=f"{record['step_s']:.2f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _reopen_array(path: Path) -> None:
    """Make a closed trace (ending in ']') appendable again: replace the bracket by a comma."""
    with open(path, "rb+") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 16))
        tail = f.read()
        stripped = tail.rstrip()
        if stripped.endswith(b"]"):
            f.seek(f.tell() - len(tail) + len(stripped) - 1)
            f.truncate()
            f.write(b",\n")


class GpuMonitor:
    """NVML utilisation and memory of the process's GPU; `sample()` returns {} without a GPU."""

    def __init__(self, device):
        self._handle = None
        if getattr(device, "type", None) != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._handle_for(pynvml, device.index or 0)
        except Exception:  # no driver or no nvidia-ml-py: report nothing rather than fail a run
            self._handle = None

    @staticmethod
    def _handle_for(pynvml, index: int):
        # NVML numbers every GPU on the machine; torch numbers the visible ones. Match by UUID.
        import torch

        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:
            return pynvml.nvmlDeviceGetHandleByIndex(index)

    def sample(self) -> dict:
        if self._handle is None:
            return {}
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {"gpu_util_percent": util.gpu, "gpu_memory_used_bytes": memory.used}
