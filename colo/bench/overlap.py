"""Section overlap: a GRPO step that trains each prompt's group while the engine still decodes the
others (colo.grpo.overlap), against the same step run serially (generate, then train).

The workload has the long tail of real reasoning runs: the toy task with completions that end at any
of vocab / mean_length stop tokens (colo.grpo.toy_task.long_tail_toy_task), so on the random model
their lengths are about geometric: most groups finish early and a few long completions decode alone
at the end. Both sides are colo.grpo's scheduler on the same random Qwen2 model, prompts and seeds,
engines compiled, in the dtype `auto` picks, both training one prompt's group per micro-batch (each
packed to its own longest completion, as the overlapped side must: so the row measures the overlap,
not padding); they take steps in turn (each going first every other round) and the row gives
means over the steps after a warm-up step (each step has other prompts, so other lengths).

Fields: colo_s / baseline_s the overlapped / serial step; ratio = serial / overlapped (goal >= 1.25 on
this workload); vs_bound = overlapped step / max(serial generate, serial train) (goal <= 1.15: the
best an overlap can do is hide the shorter phase entirely); tail_fraction: the share of the serial
generate phase with fewer than a quarter of the sequences still decoding; serial_generate_idle_core_s:
core-seconds the serial engine left idle while generating (wall x cores - the process's CPU time),
the room an overlap has on a CPU; overlap_train_s: trainer time that ran during generation;
peak_rss_bytes: the largest resident set either side saw in any phase.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from .measure import engine_unavailable_reason, ratio, rows_per_device
from .models import QWEN2_SIZES, save_random_model

SECTION = "overlap"
FULL = dict(model="qwen2-9M", prompts=16, completions=8, max_new_tokens=256, mean_length=32, steps=4)
QUICK = dict(model="qwen2-0.4M", prompts=8, completions=4, max_new_tokens=96, mean_length=16, steps=2)
WARMUP = 1
SIDES = ("serial", "overlapped")


def new_run(model_dir: Path, workload: dict, overlap: str):
    from colo.grpo import GRPOConfig, GRPOScheduler
    from colo.grpo.toy_task import long_tail_toy_task

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    config = GRPOConfig(prompts_per_step=workload["prompts"], num_generations=workload["completions"],
                        max_new_tokens=workload["max_new_tokens"], learning_rate=3e-3, save_every=0, overlap=overlap,
                        micro_batch_size=workload["completions"])
    run = GRPOScheduler(model_dir, config=config, task=long_tail_toy_task(vocab, workload["mean_length"]))
    run.generate_cpu = []  # (wall s, process CPU s) of each generation
    generate = run.engine.generate

    def timed_generate(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        out = generate(*args, **kwargs)
        run.generate_cpu.append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    run.engine.generate = timed_generate
    return run


def summarise(records: list[dict], generate_cpu: list[tuple]) -> dict:
    # Means, not medians: each step has other prompts and so other lengths, and the phases' means add
    # up to the step's mean where medians taken key by key need not.
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in records)  # noqa: E731
    cores = len(os.sched_getaffinity(0))
    summary = {key: mean(key) for key in ("step_s", "generate_s", "train_s", "reward_s", "publish_s",
                                          "phase_switch_s", "generate_tail_s", "overlap_train_s",
                                          "groups_trained_early", "completion_length_mean", "completion_length_max")}
    summary["idle_core_s"] = statistics.fmean(max(0.0, wall * cores - cpu) for wall, cpu in generate_cpu)
    summary["peak_rss_bytes"] = max(v for r in records for k, v in r.items() if k.startswith("rss_resident_bytes"))
    summary["grads_resident_bytes_during_generate"] = max(r["grads_resident_bytes_during_generate"] for r in records)
    return summary


def measure(workload: dict, progress, device: str = "cpu") -> dict:
    from colo.dtype_choice import fastest_dtype

    steps = workload["steps"]
    with tempfile.TemporaryDirectory(prefix="colo-overlap-") as tmp:
        model_dir = Path(tmp) / "model"
        params = save_random_model(model_dir, {**QWEN2_SIZES[workload["model"]],
                                               "max_position_embeddings": workload["max_new_tokens"] + 64})
        runs = {"serial": new_run(model_dir, workload, "off"), "overlapped": new_run(model_dir, workload, "on")}
        records = {side: [] for side in runs}
        try:
            if runs["overlapped"].serial_reason is not None:
                raise RuntimeError(f"the overlapped side runs serially: {runs['overlapped'].serial_reason}")
            for i in progress(range(WARMUP + steps), workload["model"]):
                for side in SIDES[i % 2:] + SIDES[:i % 2]:
                    record = runs[side].train_step()
                    if i >= WARMUP:
                        records[side].append(record)
            cpu = {side: run.generate_cpu[WARMUP:] for side, run in runs.items()}
        finally:
            for run in runs.values():
                run.close()
            del runs
            gc.collect()
    serial, overlapped = (summarise(records[side], cpu[side]) for side in SIDES)
    bound = max(serial["generate_s"], serial["train_s"])
    row = {"section": SECTION, "device": device,
           "case": (f"long-tail step {workload['model']} {fastest_dtype(device).name}: {workload['prompts']} prompts x "
                    f"{workload['completions']}, lengths ~geometric (mean {workload['mean_length']}, max "
                    f"{workload['max_new_tokens']})"),
           "model": workload["model"], "params": params, "dtype": fastest_dtype(device).name,
           "prompts": workload["prompts"], "completions_per_prompt": workload["completions"],
           "max_new_tokens": workload["max_new_tokens"], "mean_length": workload["mean_length"],
           "steps_measured": steps, "cores": len(os.sched_getaffinity(0)),
           "colo_s": overlapped["step_s"], "baseline": "the same step, serial (overlap off)",
           "baseline_s": serial["step_s"], "ratio": ratio(serial["step_s"], overlapped["step_s"]),
           "vs_bound": overlapped["step_s"] / max(bound, 1e-12),
           "tail_fraction": serial["generate_tail_s"] / max(serial["generate_s"], 1e-12),
           "serial_generate_idle_core_s": serial["idle_core_s"]}
    for side, summary in (("serial", serial), ("overlapped", overlapped)):
        for key, value in summary.items():
            row[f"{side}_{key}"] = value
    row["note"] = (f"means over {steps} steps after {WARMUP} warm-up step, the two runs taking steps in turn; "
                   "same model, prompts and seeds, engines compiled; ratio = serial / overlapped step; vs_bound = "
                   "overlapped step / max(serial generate, serial train)")
    return row


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    workload = QUICK if quick else FULL
    return rows_per_device(SECTION, "long-tail step", devices, engine_unavailable_reason,
                           lambda device: [measure(workload, progress, device)])
