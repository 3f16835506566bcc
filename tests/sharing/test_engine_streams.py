"""On a GPU the engine's steps run on the pool's high-priority `infer` stream and the overlap's trainer on
the low-priority `train` stream (colo.vllm_compat.worker, colo.pool.Stream.as_current): checked here with
recording fake streams in place of CUDA's, on colo's worker over a stand-in for vLLM's.

What vLLM 0.32's runners then use (read from its sources): both compute, sample and replay their CUDA
graphs on torch's current stream of the stepping thread, so on `infer`; V2 caches that stream as
`main_stream` (pinned to `infer` here) to order its output copy; the copies run on side streams of their
own, ordered after it. Graphs are captured on a stream of vLLM's; colo.engine sets
CUDA_GRAPHS_USE_NODE_PRIORITY=0 so their kernels take the priority of `infer`, where they are replayed."""
from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch


class FakeStream:
    def __init__(self, name: str, priority: int):
        self.name, self.priority, self.waited_for = name, priority, []

    def wait_stream(self, other) -> None:
        self.waited_for.append(other.name)

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    __hash__ = object.__hash__


class _FakeNative:
    native_handle = 0


def _fake_cuda(monkeypatch):
    """torch.cuda's current stream of this thread, recorded: (the default stream, the infer stream, log)."""
    default, infer = FakeStream("default", 0), FakeStream("infer", -5)
    current, log = [default], []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: (log.append(s.name), current.__setitem__(0, s)))
    return default, infer, current, log


def _pool(infer):
    from colo.pool import Stream

    pool = SimpleNamespace(device=torch.device("cuda", 0))
    stream = Stream(pool, "infer", _FakeNative())
    stream.torch_stream = lambda: infer
    pool.stream = lambda role: {"infer": stream}[role]
    return pool


class _V2Runner:
    @functools.cached_property
    def main_stream(self):
        return torch.cuda.current_stream()


class _V1Runner:
    pass


def _worker(pool, runner_class, seen):
    from colo.vllm_compat.worker import _ColoWorkerMixin

    class VllmWorker:  # what vLLM's Worker does with the stream: computes on torch's current one
        def execute_model(self, *args):
            seen.append(("execute_model", torch.cuda.current_stream().name))
            return "output"

        def sample_tokens(self, *args):
            seen.append(("sample_tokens", torch.cuda.current_stream().name))

        def compile_or_warm_up_model(self):
            seen.append(("warm-up", torch.cuda.current_stream().name))
            self.execute_model()  # warm-up steps run the model through the worker's own methods

        def execute_dummy_batch(self):
            seen.append(("dummy", torch.cuda.current_stream().name))

        def _make_model_runner(self):
            return runner_class()

    cls = type("ColoWorker", (_ColoWorkerMixin, VllmWorker), {})
    worker = object.__new__(cls)
    worker.colo_placement = SimpleNamespace(pool=pool)
    return worker


def test_the_engine_steps_on_the_infer_stream_between_the_callers_work(monkeypatch):
    default, infer, current, log = _fake_cuda(monkeypatch)
    seen = []
    worker = _worker(_pool(infer), _V2Runner, seen)
    assert worker.execute_model("scheduler output") == "output"
    worker.sample_tokens(None)
    worker.compile_or_warm_up_model()
    worker.execute_dummy_batch()
    assert seen == [("execute_model", "infer"), ("sample_tokens", "infer"), ("warm-up", "infer"),
                    ("execute_model", "infer"), ("dummy", "infer")]
    assert current[0] is default  # the caller's stream again after each step
    # Each step waits for the caller's work, and the caller's stream for the step's (a nested step: once).
    assert infer.waited_for == ["default"] * 4 and default.waited_for == ["infer"] * 4
    assert log == ["infer", "default"] * 4
    runner = worker._make_model_runner()
    assert runner.main_stream is infer  # V2's cached stream, pinned before its first use


def test_v1_runners_are_left_alone_and_a_host_pool_changes_nothing(monkeypatch):
    default, infer, current, log = _fake_cuda(monkeypatch)
    seen = []
    worker = _worker(_pool(infer), _V1Runner, seen)
    assert "main_stream" not in vars(worker._make_model_runner())
    host = SimpleNamespace(device=torch.device("cpu"))
    from colo.pool import Stream

    stream = Stream(host, "infer", _FakeNative())
    host.stream = lambda role: stream
    on_host = _worker(host, _V2Runner, seen)
    on_host.execute_model()
    assert seen[-1] == ("execute_model", "default") and log == [] and infer.waited_for == []
    assert "main_stream" not in vars(on_host._make_model_runner())


def test_graph_kernels_take_the_priority_of_the_stream_they_run_on():
    """Set when colo.engine is imported (before CUDA starts), unless the user set it."""
    import subprocess
    import sys

    show = "import colo.engine, os; print(os.environ['CUDA_GRAPHS_USE_NODE_PRIORITY'])"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_GRAPHS_USE_NODE_PRIORITY"}
    assert subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True).stdout.strip() == "0"
    mine = subprocess.run([sys.executable, "-c", show], env={**env, "CUDA_GRAPHS_USE_NODE_PRIORITY": "1"},
                          capture_output=True, text=True)
    assert mine.stdout.strip() == "1"
