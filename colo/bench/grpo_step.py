"""Section grpo_step: one full GRPO step (generate, reward, train, publish) colocated on one device,
against the same step done the usual way.

Both sides run colo.grpo's scheduler on the same random Qwen2 model, toy task, prompts and seeds
(8 prompts x 8 completions per step):

- colo: the scheduler as it runs by default (dtype "auto": colo.dtype_choice), and (full run) again in
  the other dtype, one row each, so the bench backs auto's choice on the machine that runs it: the
  engine compiled with the kernels vLLM picks,
  trainer and engine sharing one copy of the weights (publish copies nothing; on a CPU it repacks
  vLLM's packed kernel copies); the KV cache sleeps while training, gradients sleep while
  generating, and optimizer state is offloaded while generating where that frees device memory
  (GPU; the scheduler's default skips it on the host, where it would copy RAM to RAM).
- baseline ("the usual way", as TRL's colocate mode does it): the trainer loads its own fp32 copy of
  the weights, the engine serves vLLM's default dtype (bf16 for this fp32 checkpoint on x86 CPUs
  and recent GPUs, whatever the CPU kind), and after each optimizer step TRL's sync (`baselines.trl_sync_weights`) pushes every
  parameter through vLLM's load_weights; nothing sleeps, the KV cache stays resident through
  training. Its engine is compiled too. Where vLLM packed the CPU linears, stock vLLM cannot take
  weights in place (stock TRL crashes at its first sync), so the baseline runs on the named variant
  with the packed kernels disabled (F.linear); the row says so and gives both sides' kernels.

The step runs where the installed vLLM runs its engines (the scheduler takes the GPU when torch sees
one); the CUDA case has not run on a GPU yet, and there phase times are host-side: GPU work still
queued when a phase ends is counted in the next one (step times are whole).

The three schedulers live side by side and take steps in turn (each going first every third round), so
load from other processes, and whatever one side's step leaves behind for the next, hits all
alike; after warm-up steps (vLLM's first calls are slow) the row gives medians per phase for both
(colo_<phase>_s, baseline_<phase>_s), the step-time ratio and the KV cache bytes resident during
training. The sides train alike (same seeds), so their batches stay comparable.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import tempfile
from pathlib import Path

from .baselines import UPDATABLE_VARIANT, stock_update_refused, trl_sync_weights
from .measure import (engine_unavailable_reason, gemm_peak_flops, matmul_parameters, ratio, rows_per_device,
                      wait_for_started_processes)
from .models import MAX_POSITIONS, QWEN2_SIZES, save_random_model

SECTION = "grpo_step"
COMPLETION_TOKENS = {"qwen2-0.4M": 16, "qwen2-9M": 16, "qwen2-45M": 32}  # model (models.QWEN2_SIZES) -> tokens
QUICK_SIZES, FULL_SIZES = ("qwen2-9M",), ("qwen2-0.4M", "qwen2-9M", "qwen2-45M")
PHASES = ("generate", "reward", "train", "publish", "phase_switch")
WARMUP = 2


def save_model(directory: Path, name: str) -> int:
    """Save the random fp32 model `name` to `directory`; returns its parameter count."""
    return save_random_model(directory, {**QWEN2_SIZES[name], "max_position_embeddings": MAX_POSITIONS})


def new_run(model_dir: Path, max_new_tokens: int, colocated: bool, dtype: str | None = None, eager: bool = False,
            prompts: int = 8, completions: int = 8):
    """A GRPO scheduler for one side of the comparison. colocated: colo's way, one copy in `dtype`
    (None: colo's auto choice); otherwise the usual way, whose engine serves what vLLM picks itself.
    eager: engines not compiled (for measurements of memory, not time). prompts x completions per step."""
    import torch

    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask
    from colo.shared import PublishReport
    from colo.vllm_compat import served_dtype
    from colo.vllm_compat.forced_kernels import forced_cpu_gemm

    task = ToyTask(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    config = GRPOConfig(prompts_per_step=prompts, num_generations=completions, max_new_tokens=max_new_tokens,
                        ignore_eos=True, learning_rate=3e-3, save_every=0,
                        memory_phases=colocated, offload_optimizer=None if colocated else False,
                        dtype=dtype if colocated else {torch.bfloat16: "bf16"}.get(served_dtype(model_dir), "fp32"))
    eager_option = {"enforce_eager": True} if eager else {}
    if colocated:
        return GRPOScheduler(model_dir, task.rewards, task.prompts, config, engine_options=eager_option)
    on_cpu = not torch.cuda.is_available()
    with forced_cpu_gemm("plain") if on_cpu else contextlib.nullcontext():
        # As TRL does: an fp32 trainer (fp32 AdamW), its weights pushed into a separate engine copy
        # that serves vLLM's own default dtype (bf16 for this fp32 checkpoint on x86 CPUs and GPUs).
        run = GRPOScheduler(model_dir, task.rewards, task.prompts, config,
                            engine_options={"alias": False, "trainer_dtype": torch.float32, **eager_option})
    engine = run.engine
    engine.publish = lambda: PublishReport(**trl_sync_weights(engine.llm, engine.hf_model))
    return run


def compile_colo_engine() -> None:
    """Build the quick run's colo side (its engine compiled in the dtype auto picks) and close it: run
    ahead in a fresh process (COMPILE_AHEAD), so that a fresh machine's compile caches have its code. Not
    where auto picks bf16: that engine's compiled code is publish's, which publish builds meanwhile."""
    import torch

    from colo.dtype_choice import fastest_dtype

    if fastest_dtype("cuda" if torch.cuda.is_available() else "cpu").name == "bf16":
        return
    name = QUICK_SIZES[0]
    with tempfile.TemporaryDirectory(prefix="colo-grpo-step-ahead-") as tmp:
        save_model(Path(tmp) / "model", name)
        new_run(Path(tmp) / "model", COMPLETION_TOKENS[name], True).close()


COMPILE_AHEAD = (compile_colo_engine,)  # colo.bench.runner.fresh_process_plan


def summarise(records: list[dict]) -> dict:
    summary = {f"{phase}_s": statistics.median(r.get(f"{phase}_s", 0.0) for r in records) for phase in PHASES}
    summary["step_s"] = statistics.median(r["step_s"] for r in records)
    summary["kv_cache_resident_bytes_during_train"] = max(r["kv_cache_resident_bytes_during_train"] for r in records)
    summary["publish_bytes_copied"] = max(r["publish_bytes_copied"] for r in records)
    summary["train_positions"] = statistics.median(r.get("train_positions", 0) for r in records)
    summary["padding_fraction"] = statistics.median(r.get("padding_fraction", 0.0) for r in records)
    return summary


def measure_size(name: str, steps: int, progress, device: str = "cpu", other_dtype: bool = True) -> list[dict]:
    """Two rows for model `name`: colo in the dtype its auto rule picks here, then (other_dtype) colo in
    the other dtype, each against the same usual-way baseline (the runs take their steps in turn)."""
    from colo.dtype_choice import BY_NAME, NAMES, fastest_dtype
    from colo.engine import cpu_kernels
    from colo.vllm_compat import engine_dtype

    max_new_tokens = COMPLETION_TOKENS[name]
    choice = fastest_dtype(device)
    other = "fp32" if choice.name == "bf16" else "bf16"
    with tempfile.TemporaryDirectory(prefix="colo-grpo-step-") as tmp:
        model_dir = Path(tmp) / "model"
        params = save_model(model_dir, name)
        from transformers import AutoConfig

        matmul = matmul_parameters(AutoConfig.from_pretrained(model_dir))
        runs = {"colo": new_run(model_dir, max_new_tokens, True),
                **({"colo_other": new_run(model_dir, max_new_tokens, True, dtype=other)} if other_dtype else {}),
                "baseline": new_run(model_dir, max_new_tokens, False)}
        wait_for_started_processes()  # what the run started while these engines were built (fork server, compile-ahead)
        kernels = {side: cpu_kernels(run.engine.llm) for side, run in runs.items()}
        dtypes = {side: NAMES[engine_dtype(run.engine.llm)] for side, run in runs.items()}
        ran_on = {run.device.type for run in runs.values()}
        if ran_on != {device}:  # the scheduler picks the GPU whenever torch sees one
            raise RuntimeError(f"asked for a {device} step but the scheduler runs on {', '.join(sorted(ran_on))}")
        assert dtypes["colo"] == choice.name, (dtypes, choice)
        records = {side: [] for side in runs}
        try:
            # Alternate the sides step by step so that load from other processes on a shared machine
            # hits all alike, and rotate which goes first each round: the side that runs right after
            # another's training measured a slower generate phase (up to 10% here) with identical
            # kernels. The first WARMUP steps of each (vLLM's slow first calls) are dropped.
            sides = list(runs)
            for i in progress(range(WARMUP + steps), name):
                for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                    record = runs[side].train_step()
                    if i >= WARMUP:
                        records[side].append(record)
        finally:
            for run in runs.values():
                run.close()
            del runs
            gc.collect()
    summaries = {side: summarise(records[side]) for side in records}
    base_side = summaries["baseline"]
    refused = stock_update_refused(kernels["colo"])
    baseline = "usual way: own fp32 weights, TRL's per-parameter sync into an engine in vLLM's default dtype, no memory phasing"
    rows = []
    for side, why in (("colo", f"auto: {choice.reason}"), ("colo_other", "the dtype auto did not pick, for comparison")):
        if side not in summaries:
            continue
        colo_side = summaries[side]
        row = {"section": SECTION, "case": f"grpo step {name} {dtypes[side]}" + (" (auto)" if side == "colo" else ""),
               "device": device, "model": name, "params": params, "dtype": dtypes[side], "dtype_auto": side == "colo",
               "dtype_why": why, "prompts": 8, "completions_per_prompt": 8, "max_new_tokens": max_new_tokens,
               "steps_measured": steps, "colo_s": colo_side["step_s"],
               "baseline": f"{baseline}, on {UPDATABLE_VARIANT}" if refused else baseline,
               "baseline_dtype": dtypes["baseline"], "baseline_s": base_side["step_s"],
               "ratio": ratio(base_side["step_s"], colo_side["step_s"]),
               "colo_cpu_kernels": kernels[side], "baseline_cpu_kernels": kernels["baseline"]}
        for label, values in (("colo", colo_side), ("baseline", base_side)):
            for phase in PHASES:
                row[f"{label}_{phase}_s"] = values[f"{phase}_s"]
            row[f"{label}_kv_cache_resident_bytes_during_train"] = values["kv_cache_resident_bytes_during_train"]
            row[f"{label}_publish_bytes_copied"] = values["publish_bytes_copied"]
        # The train phase's rate against the machine's matmul peak in the same dtype, measured now:
        # 6 x matmul weights x positions computed (forward and backward), the attention's products
        # and the chunked head's recompute left out, so this understates the work done.
        flops = 6 * matmul * colo_side["train_positions"]
        peak = gemm_peak_flops(BY_NAME[dtypes[side]])
        row.update(train_positions=colo_side["train_positions"], padding_fraction=colo_side["padding_fraction"],
                   train_flops_per_s=flops / max(colo_side["train_s"], 1e-12), gemm_peak_flops_per_s=peak,
                   train_vs_gemm_peak=flops / max(colo_side["train_s"], 1e-12) / peak)
        # Flat aliases of colo's own phases, the names the step log uses.
        row.update(generate_s=colo_side["generate_s"], train_s=colo_side["train_s"], publish_s=colo_side["publish_s"])
        row["note"] = (f"medians over {steps} steps after {WARMUP} warm-up steps, the runs (colo in "
                       + ("each dtype" if other_dtype else "the dtype auto picks; the full run adds the other")
                       + ", the usual way) taking steps in turn, each going first in turn; same model, prompts "
                       "and seeds, all engines compiled"
                       + (f"; stock vLLM cannot be the baseline here: {refused}" if refused else ""))
        rows.append(row)
    if other_dtype:
        auto, other_row = rows
        auto["auto_vs_other_dtype"] = ratio(other_row["colo_s"], auto["colo_s"])  # > 1: auto picked the faster one
    return rows


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    def measure(device: str) -> list[dict]:
        # The quick run measures the dtype auto picks only: the other one is bf16 on CPUs without bf16
        # instructions, where torch emulates it and the step takes minutes.
        steps = 2 if quick else 6
        return [row for name in (QUICK_SIZES if quick else FULL_SIZES)
                for row in measure_size(name, steps, progress, device, other_dtype=not quick)]

    return rows_per_device(SECTION, "grpo step", devices, engine_unavailable_reason, measure)
