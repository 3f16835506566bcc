"""Section overlap: a GRPO step that trains each prompt's group while the engine still decodes the
others (colo.grpo.overlap), against the same step run serially (generate, then train).

The workload has the long tail of real reasoning runs: the toy task with completions that end at any
of vocab / mean_length stop tokens (colo.grpo.toy_task.long_tail_toy_task), so on the random model
their lengths are about geometric: most groups finish early and a few long completions decode alone
at the end. Both sides are colo.grpo's scheduler on the same random Qwen2 model, prompts and seeds,
engines compiled, in the dtype `auto` picks (a workload's "dtype" decides instead), both training
one prompt's group per micro-batch (each packed to its own longest completion, as the overlapped
side must: so the row measures the overlap, not padding); they take steps in turn (each going first
in turn) and the rows give means over the steps after a warm-up step (each step has other prompts,
so other lengths). One row per split of the CPU's threads between engine and trainer while both have
work (GRPOConfig.overlap_threads): the default (half each) in the quick run; the full run adds each
side on half or all of the cores (oversubscribed where they add up to more), every split a run of its
own beside the same serial one.

Fields: colo_s / baseline_s the overlapped / serial step; ratio = serial / overlapped (goal >= 1.25 on
this workload); vs_bound = overlapped step / max(serial generate, serial train) (goal <= 1.15: the
best an overlap can do is hide the shorter phase entirely); tail_fraction: the share of the serial
generate phase with fewer than a quarter of the sequences still decoding; serial_generate_idle_core_s:
core-seconds the serial engine left idle while generating (wall x cores - the process's CPU time;
OpenMP threads that spin while waiting count as busy); serial_generate_on_engine_share_s: each serial
generation run again between steps, alone, with the engine on the threads the default split leaves
it; given_cores_idle_fraction: from those two, how much of the generation the cores the engine gives
the trainer were in effect idle (1: the engine on its share generates as fast as on every core, so
an overlap can have them for free; 0: it slows in proportion to the cores), the room an overlap has
on a CPU; overlap_train_s: trainer time that ran during generation; peak_rss_bytes: the largest
resident set either side saw in any phase; engine_step_s_median (each side) and decode_step_ratio: an
engine step's seconds with the trainer working beside it against alone (the overlap's cost to decode
latency); *_gil_share_*: the share of a step's wall time the step's thread, the overlap's trainer
thread and any thread held Python's GIL (py-spy, where installed): on a GPU, where kernels are
asynchronous, the engine's decode loop and the trainer are mostly Python, and these bound the overlap.
"""
from __future__ import annotations

import gc
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from .measure import GilShares, engine_unavailable_reason, ratio, rows_per_device
from .models import MAX_POSITIONS, QWEN2_SIZES, save_random_model

SECTION = "overlap"
FULL = dict(model="qwen2-9M", prompts=16, completions=8, max_new_tokens=256, mean_length=32, steps=4, every_split=True,
            learning_rate=3e-3)
QUICK = dict(model="qwen2-0.4M", prompts=8, completions=4, max_new_tokens=96, mean_length=16, steps=2,
             every_split=False, learning_rate=3e-3)
# The real task: SmolLM2-135M-Instruct on the arithmetic chat dataset, its EOS ending each completion
# (most answer in a few tokens; some go on to the cap), TRL's learning rate for a real model.
REAL = dict(model="smollm2-135M", dataset="arithmetic", prompts=8, completions=8, max_new_tokens=128, steps=2,
            every_split=False, learning_rate=1e-6)
WARMUP = 1


def new_run(model_dir: Path, workload: dict, task, overlap: str, threads: tuple[int, int] | None = None):
    """A scheduler of the workload; task() gives what it trains on (GRPOScheduler's keywords)."""
    from colo.grpo import GRPOConfig, GRPOScheduler

    config = GRPOConfig(prompts_per_step=workload["prompts"], num_generations=workload["completions"],
                        max_new_tokens=workload["max_new_tokens"], save_every=0, overlap=overlap,
                        overlap_threads=threads, micro_batch_size=workload["completions"],
                        learning_rate=workload["learning_rate"], dtype=workload.get("dtype"))
    run = GRPOScheduler(model_dir, config=config, **task())
    run.generate_cpu = []  # (wall s, process CPU s) of each generation
    generate = run.engine.generate

    def timed_generate(*args, **kwargs):
        run.last_generate = (generate, args, kwargs)
        wall, cpu = time.perf_counter(), time.process_time()
        out = generate(*args, **kwargs)
        run.generate_cpu.append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    run.engine.generate = timed_generate
    return run


def generate_again(run, threads: int) -> float:
    """Seconds the run's last generation takes again, between steps, with the engine on `threads`
    threads (the same seeds draw the same completions; they are dropped). The KV cache sleeps after,
    as the step left it."""
    import torch

    from colo.grpo.rollout_engine import GenerationTrace

    generate, args, kwargs = run.last_generate
    run.engine.wake_kv_cache()
    threads_before = torch.get_num_threads()
    torch._C.set_num_threads(threads)  # vLLM's CPU worker makes torch.set_num_threads a no-op
    try:
        started = time.perf_counter()
        generate(*args, **{**kwargs, "trace": GenerationTrace()})
        return time.perf_counter() - started
    finally:
        torch._C.set_num_threads(threads_before)
        run.engine.sleep_kv_cache()


def summarise(records: list[dict], generate_cpu: list[tuple]) -> dict:
    # Means, not medians: each step has other prompts and so other lengths, and the phases' means add
    # up to the step's mean where medians taken key by key need not.
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in records)  # noqa: E731
    cores = len(os.sched_getaffinity(0))
    summary = {key: mean(key) for key in ("step_s", "generate_s", "train_s", "reward_s", "publish_s",
                                          "phase_switch_s", "generate_tail_s", "overlap_train_s",
                                          "groups_trained_during_generation", "completion_length_mean",
                                          "completion_length_max",
                                          "engine_step_s_median")}
    summary["idle_core_s"] = statistics.fmean(max(0.0, wall * cores - cpu) for wall, cpu in generate_cpu)
    summary["peak_rss_bytes"] = max(v for r in records for k, v in r.items() if k.startswith("rss_resident_bytes"))
    summary["grads_resident_bytes_during_generate"] = max(r["grads_resident_bytes_during_generate"] for r in records)
    return summary


def thread_splits(cores: int, every: bool) -> list[tuple[int, int]]:
    """(engine, trainer) threads to measure: the default split first; every=True adds each side on half
    or all of the cores (on 2 cores: 1+1, 1+2, 2+1, 2+2)."""
    from colo.grpo.overlap import cpu_split

    default = cpu_split(cores)
    if not every:
        return [default]
    halves = {side: sorted({n, cores}) for side, n in zip(("engine", "trainer"), default)}
    return [default] + [(e, t) for e in halves["engine"] for t in halves["trainer"] if (e, t) != default]


def measure(workload: dict, progress, device: str = "cpu") -> list[dict]:
    from colo.grpo.overlap import cpu_split

    steps, cores = workload["steps"], len(os.sched_getaffinity(0))
    splits = thread_splits(cores, workload["every_split"])
    engine_share = cpu_split(cores)[0]
    sides = ["serial"] + [f"overlapped {e}+{t}" for e, t in splits]
    with tempfile.TemporaryDirectory(prefix="colo-overlap-") as tmp:
        model_dir, params, lengths, task = prepare(workload, Path(tmp))
        runs = {"serial": new_run(model_dir, workload, task, "off")}
        runs.update({side: new_run(model_dir, workload, task, "on", threads=split)
                     for side, split in zip(sides[1:], splits)})
        records, on_share = {side: [] for side in runs}, []  # on_share: the serial generations again, on engine_share
        gil = {side: [] for side in runs}  # each measured step's GIL shares (colo.bench.measure.GilShares)
        try:
            for side in sides[1:]:
                if runs[side].serial_reason is not None:
                    raise RuntimeError(f"the overlapped side runs serially: {runs[side].serial_reason}")
            for i in progress(range(WARMUP + steps), workload["model"]):
                for side in sides[i % len(sides):] + sides[:i % len(sides)]:  # each side goes first in turn
                    with GilShares() as held:
                        record = runs[side].train_step()
                    if i >= WARMUP:
                        records[side].append(record)
                        gil[side].append(held)
                        if side == "serial":
                            on_share.append(generate_again(runs[side], engine_share))
            cpu = {side: run.generate_cpu[WARMUP:] for side, run in runs.items()}
            dtype = runs["serial"].config.dtype
        finally:
            for run in runs.values():
                run.close()
            del runs
            gc.collect()
    serial = summarise(records["serial"], cpu["serial"])
    # How much of the serial generation the cores the engine gives the trainer were in effect idle: 1 when
    # the engine on its share generates as fast as on every core, 0 when it slows in proportion to the cores.
    on_share = statistics.fmean(on_share)
    full_use = serial["generate_s"] * cores / engine_share
    given_cores_idle = (None if engine_share >= cores else  # one core: nothing to give
                        min(1.0, max(0.0, (full_use - on_share) / (full_use - serial["generate_s"]))))
    bound = max(serial["generate_s"], serial["train_s"])
    rows = []
    for side, (engine_threads, trainer_threads) in zip(sides[1:], splits):
        overlapped = summarise(records[side], cpu[side])
        row = {"section": SECTION, "device": device,
               "case": (f"long-tail step {workload['model']} {dtype}: {workload['prompts']} prompts x "
                        f"{workload['completions']}, {lengths}, threads engine+trainer "
                        f"{engine_threads}+{trainer_threads}"),
               "model": workload["model"], "params": params, "dtype": dtype,
               "prompts": workload["prompts"], "completions_per_prompt": workload["completions"],
               "max_new_tokens": workload["max_new_tokens"], "mean_length": workload.get("mean_length"),
               "steps_measured": steps, "cores": cores, "engine_threads": engine_threads,
               "trainer_threads": trainer_threads, "default_split": (engine_threads, trainer_threads) == splits[0],
               "colo_s": overlapped["step_s"], "baseline": "the same step, serial (overlap off)",
               "baseline_s": serial["step_s"], "ratio": ratio(serial["step_s"], overlapped["step_s"]),
               "vs_bound": overlapped["step_s"] / max(bound, 1e-12),
               "tail_fraction": serial["generate_tail_s"] / max(serial["generate_s"], 1e-12),
               "serial_generate_idle_core_s": serial["idle_core_s"],
               "serial_generate_on_engine_share_s": on_share, "engine_share_threads": engine_share,
               "given_cores_idle_fraction": given_cores_idle}
        for name, summary in (("serial", serial), ("overlapped", overlapped)):
            for key, value in summary.items():
                row[f"{name}_{key}"] = value
        # The overlap's effect on decoding: an engine step's seconds with the trainer beside it, against alone.
        row["decode_step_ratio"] = overlapped["engine_step_s_median"] / max(serial["engine_step_s_median"], 1e-12)
        row.update(gil_fields(gil["serial"], "serial"), **gil_fields(gil[side], "overlapped"))
        row["note"] = (f"means over {steps} steps after {WARMUP} warm-up step, the {len(sides)} runs taking steps in "
                       "turn; same model, prompts and seeds, engines compiled; ratio = serial / overlapped step; "
                       "vs_bound = overlapped step / max(serial generate, serial train)")
        rows.append(row)
    return rows


def gil_fields(steps: list, side: str) -> dict:
    """The share of each step's wall time the step's thread (MainThread: the engine and, serially, the
    trainer), the overlap's trainer thread and any thread held the GIL, means over the steps."""
    if not steps or not steps[0].shares:
        return {f"{side}_gil_note": steps[0].missing if steps else "no steps"}
    fields = {}
    for key, thread in (("main_thread", "MainThread"), ("trainer_thread", "colo-group-trainer"), ("any", "any")):
        fields[f"{side}_gil_share_{key}"] = statistics.fmean(s.shares.get(thread, 0.0) for s in steps)
    return fields


def prepare(workload: dict, tmp: Path):
    """The workload's model directory, its parameter count, how its completion lengths come about, and
    task(): what each run trains on, as GRPOScheduler's keywords (a new toy task per run)."""
    if "dataset" in workload:
        from safetensors import safe_open

        from colo.grpo.arithmetic import write
        from colo.smollm2 import smollm2_dir

        dataset = str(write(tmp / "data")[0])
        model_dir, params = smollm2_dir(), 0
        for path in model_dir.glob("*.safetensors"):
            with safe_open(str(path), "pt") as weights:
                params += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
        lengths = f"arithmetic chat prompts, lengths as the model ends them at EOS (max {workload['max_new_tokens']})"
        return model_dir, params, lengths, lambda: dict(dataset=dataset, reward_funcs=["math"])
    from colo.grpo.toy_task import long_tail_toy_task

    model_dir = tmp / "model"
    positions = max(MAX_POSITIONS, workload["max_new_tokens"] + 64)
    config = {**QWEN2_SIZES[workload["model"]], "max_position_embeddings": positions}
    params = save_random_model(model_dir, config)
    lengths = f"lengths ~geometric (mean {workload['mean_length']}, max {workload['max_new_tokens']})"
    vocab, mean_length = config["vocab_size"], workload["mean_length"]
    return model_dir, params, lengths, lambda: dict(task=long_tail_toy_task(vocab, mean_length))


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    workloads = [QUICK] if quick else [FULL, REAL]
    return rows_per_device(SECTION, "long-tail step", devices, engine_unavailable_reason,
                           lambda device: [row for w in workloads for row in measure(w, progress, device)])
