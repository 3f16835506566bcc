"""Section tool_calls: what running a tool call in a worker process costs (colo.grpo's default,
`--tool-isolation process`) beside running it on a thread of the training process (TRL's way, and
`--tool-isolation thread`).

The same trivial tool (an addition), so the figure is the isolation's own overhead per call: submit, the
call, its result back, one call at a time; median over the calls. Tools that do real work take
milliseconds to seconds, so the difference matters only for the cheapest ones.
"""
from __future__ import annotations

import statistics
import time

SECTION = "tool_calls"


def _add(a: int, b: int) -> int:
    return a + b


def per_call_seconds(runner, calls: int) -> float:
    from colo.grpo.tools import ToolCall

    tools, samples = {"add": _add}, []
    for i in range(calls):
        started = time.perf_counter()
        pending = runner.submit(ToolCall("add", {"a": i, "b": 1}), tools)
        pending.future.result()
        if pending.result(None).content != str(i + 1):
            raise RuntimeError(f"the tool returned {pending.result(None).content!r}")
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run(quick: bool, progress) -> list[dict]:
    from colo.grpo.tool_workers import ToolWorkers
    from colo.grpo.tools import ToolRunner

    calls = 200 if quick else 2000
    steps = iter(progress(range(2), "tool calls"))
    thread = ToolRunner(timeout=None)
    workers = ToolWorkers({"add": _add}, size=1)
    process = ToolRunner(timeout=None, workers=workers)
    try:
        per_call_seconds(process, 10)   # the worker's start
        next(steps, None)
        thread_s, process_s = per_call_seconds(thread, calls), per_call_seconds(process, calls)
        next(steps, None)
    finally:
        thread.close()
        process.close()
        workers.close()
    return [{"section": SECTION, "device": "cpu", "case": "tool call in a worker process", "colo_s": process_s,
             "baseline": "the same call on a thread of the training process (TRL; --tool-isolation thread)",
             "baseline_s": thread_s, "ratio": thread_s / process_s, "calls": calls,
             "note": "a trivial tool (an addition), one call at a time, median: the isolation's own cost per call"}]
