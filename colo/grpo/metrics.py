"""What a GRPO run reports: a JSON-lines step log, a Chrome-trace/Perfetto timeline of the phases,
the statistics of a step that span ranks (rewards, completion lengths, the loss), each region's
resident bytes per phase, and GPU utilisation and memory from NVML when a GPU is present.

The timeline uses the Chrome trace "JSON array" form written one event per line: the closing
bracket is optional in that format, so a run killed mid-way still leaves a file that
chrome://tracing and ui.perfetto.dev open.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch

from ..sizes import rss_bytes
from . import distributed


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

    def __init__(self, steps: int, done: int, enabled: bool, file=None):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=done, desc="colo.grpo", unit="step", dynamic_ncols=True, file=file)

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


# -- a step's statistics over every rank ---------------------------------------------------------

def scored_mean_std(values: torch.Tensor, world) -> tuple[float, float]:
    """Mean and std (Bessel's correction, as TRL's nanstd) of the non-NaN values of every
    data-parallel rank's batch."""
    scored = values[~torch.isnan(values)].double()
    n, total, squares = distributed.sum_floats([scored.numel(), scored.sum().item(), (scored ** 2).sum().item()],
                                     world, data_parallel=True)
    mean = total / n if n else math.nan
    std = math.sqrt(max(squares - total * mean, 0.0) / (n - 1)) if n > 1 else 0.0
    return mean, std


def reward_stats(scores, rollout, world) -> dict:
    """Rewards overall and per function (mean, std, as TRL logs them) and the completions' lengths."""
    record = {}
    record["reward_mean"], record["reward_std"] = scored_mean_std(scores.total, world)
    for i, name in enumerate(scores.names):
        record[f"rewards/{name}/mean"], record[f"rewards/{name}/std"] = scored_mean_std(scores.per_function[:, i],
                                                                                        world)
    lengths = rollout.model_tokens()  # the model's tokens (an agentic rollout's tool results not counted)
    n, tokens, clipped, unscored = distributed.sum_floats(
        [len(lengths), sum(lengths), sum(rollout.truncated), float(torch.isnan(scores.total).sum())],
        world, data_parallel=True)
    shortest, longest = distributed.min_max(min(lengths), max(lengths), world)
    record.update(tokens_generated=int(tokens), completion_length_mean=tokens / n, completion_length_min=shortest,
                  completion_length_max=longest, clipped_ratio=clipped / n, unscored_completions=int(unscored))
    return record


def train_stats(stats: dict, world) -> dict:
    """Loss, clip fraction and KL averaged over the data-parallel ranks; where the sampled tokens'
    engine log-probabilities were compared, the trainer's gap to them."""
    record = dict(zip(("loss", "clip_fraction", "kl"), (
        v / world.dp_size for v in distributed.sum_floats([stats["loss"], stats["clip_fraction"], stats["kl"]], world,
                                                data_parallel=True))))
    # The positions the trainer's forward computed, and how many of them were padding.
    positions, padded = distributed.sum_floats([stats.get("positions", 0.0), stats.get("padded_positions", 0.0)], world,
                                               data_parallel=True)
    record["train_positions"], record["padding_fraction"] = int(positions), padded / max(positions, 1.0)
    if "engine_logprob_max_abs_diff" in stats:
        gap, tokens = distributed.sum_floats([stats["engine_logprob_abs_diff_sum"], stats["engine_logprob_tokens"]],
                                   world, data_parallel=True)
        record["engine_logprob_max_abs_diff"] = distributed.min_max(0.0, stats["engine_logprob_max_abs_diff"], world)[1]
        record["engine_logprob_mean_abs_diff"] = gap / max(tokens, 1.0)
    if "aux_loss" in stats:  # the MoE load-balancing loss: its mean over the data-parallel ranks
        record["aux_loss"] = distributed.sum_floats([stats["aux_loss"]], world, data_parallel=True)[0] / world.dp_size
    if "router_compared" in stats:  # a MoE model: how often the trainer's experts differ from the engine's
        tokens, differed = distributed.sum_floats([stats["router_compared"], stats["router_mismatch"] * stats["router_compared"]],
                                                  world, data_parallel=True)
        record["router_mismatch"], record["router_compared"] = differed / max(tokens, 1.0), int(tokens)
    if "sampling/tokens" in stats:  # importance sampling: min and max over ranks, means weighted by tokens
        tokens = stats["sampling/tokens"]
        means = [k for k in stats if k.startswith("sampling/") and k.endswith("/mean")]
        summed = distributed.sum_floats([tokens, *(stats[k] * tokens for k in means)], world, data_parallel=True)
        for key, total in zip(means, summed[1:]):
            record[key] = total / max(summed[0], 1.0)
        for key in (k for k in stats if k.startswith("sampling/") and k.endswith(("/min", "/max"))):
            low, high = distributed.min_max(stats[key], stats[key], world)
            record[key] = low if key.endswith("/min") else high
    return record


class Residency:
    """The pool's resident bytes per region (and the process's RSS, and the GPU's NVML figures): the
    largest seen in each phase of a step, `{region}_resident_bytes_during_{phase}`, until take()."""

    def __init__(self, pool, device):
        self.pool = pool
        self.gpu = GpuMonitor(device)
        self._seen: dict = {}

    def resident(self) -> dict:
        return {name: s["resident_bytes"] for name, s in self.pool.stats().items()}

    def sample(self, phase: str) -> None:
        for region, nbytes in [*self.resident().items(), ("rss", rss_bytes())]:
            key = f"{region}_resident_bytes_during_{phase}"
            self._seen[key] = max(self._seen.get(key, 0), nbytes)
        for key, value in self.gpu.sample().items():
            self._seen[f"{key}_{phase}"] = value

    def take(self) -> dict:
        """What was sampled since the last take()."""
        seen, self._seen = self._seen, {}
        return seen


def agent_stats(completions, stats, world) -> dict:
    """An agentic step's figures over every data-parallel rank (colo.grpo.agent): tool calls per rollout
    and the share of them that failed (TRL's tools/call_frequency, tools/failure_frequency), calls that
    could not be read and calls that timed out, the share of rollouts that called a tool, turns per
    rollout, the prompt tokens the engine computed against those in context over all turns (the rest
    came from vLLM's prefix cache), and the seconds the engine had nothing to decode while tools ran."""
    def total(name):
        return float(sum(getattr(c, name, 0) for c in completions))

    (n, calls, failures, malformed, timeouts, calling, turns, in_context, computed, idle, tool_s) = distributed.sum_floats(
        [float(len(completions)), total("tool_calls"), total("tool_failures"), total("malformed_calls"),
         total("timeouts"), float(sum(getattr(c, "tool_calls", 0) > 0 for c in completions)), total("turns"),
         total("prefill_in_context"), total("prefill_computed"), stats.engine_idle_s, stats.tool_s],
        world, data_parallel=True)
    most_turns = distributed.min_max(0.0, max((getattr(c, "turns", 1) for c in completions), default=0), world)[1]
    return {"tools/call_frequency": calls / max(n, 1.0), "tools/failure_frequency": failures / max(calls, 1.0),
            "tools/malformed_calls": int(malformed), "tools/timeouts": int(timeouts),
            "tools/rollouts_calling": calling / max(n, 1.0), "turns_mean": turns / max(n, 1.0), "turns_max": int(most_turns),
            "prefill_tokens_in_context": int(in_context), "prefill_tokens_computed": int(computed),
            "prefix_cache_hit_rate": 1.0 - computed / max(in_context, 1.0),
            "engine_idle_during_tools_s": idle / world.dp_size, "tool_s": tool_s}
