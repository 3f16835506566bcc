"""Section memory: bytes per parameter resident in each phase of a GRPO step, for colo in bf16, colo
in fp32, and the usual way, measured on the same model and batch in the same run.

- colo bf16: the engine serves bf16 weights and the trainer's parameters are those tensors; fp32
  master weights and AdamW moments in the `optimizer` region, fp32 main gradients in `grads`.
- colo fp32: the same with fp32 weights (no masters).
- usual way (TRL's colocate mode): an fp32 trainer with fp32 gradients and AdamW moments, and a
  separate bf16 copy of the weights in the engine, synced per parameter; nothing sleeps.

Both colo rows run with the optimizer state offloaded while generating (`offload_optimizer=True`),
the scheduler's default on a GPU, where it frees device memory; on a host pool "offloaded" lands
in the same RAM, so the region figures show what a GPU would hold, and the process RSS
(`rss_bytes_<phase>`) shows what this machine held. Figures come from the step log the scheduler
writes (each region's resident bytes, sampled during each phase), second step of each run (the
first creates the optimizer state). The trainer's own weights in the usual way live outside the
pool and are counted from their tensors. The KV cache is reported on its own
(`kv_cache_bytes_<phase>`): its size depends on the batch, not on the parameters.
"""
from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

from colo.regions import GRADS, OPTIMIZER, WEIGHTS
from colo.sizes import tensor_bytes

from .grpo_step import save_model
from .measure import engine_unavailable_reason, rows_per_device

SECTION = "memory"
PHASES = {"generate": "generate", "train": "train", "publish": "publish"}  # row name -> step log name
REGIONS = (WEIGHTS, GRADS, OPTIMIZER)
QUICK_SIZES, FULL_SIZES = ("qwen2-9M",), ("qwen2-9M", "qwen2-45M")
CONFIGS = ("colo bf16", "colo fp32", "usual way")
# Prompts, completions per prompt, completion tokens. The quick run's smaller batch changes the KV cache
# and activations, not the bytes per parameter of the weights, gradients and optimizer state.
FULL_BATCH, QUICK_BATCH = (8, 8, 16), (2, 4, 8)


def new_run(model_dir: Path, config_name: str, quick: bool = False):
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask

    from .grpo_step import new_run as grpo_step_run

    prompts, completions, tokens = QUICK_BATCH if quick else FULL_BATCH
    if config_name == "usual way":
        return grpo_step_run(model_dir, max_new_tokens=tokens, colocated=False, eager=quick, prompts=prompts,
                             completions=completions)
    task = ToyTask(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    config = GRPOConfig(prompts_per_step=prompts, num_generations=completions, max_new_tokens=tokens, ignore_eos=True,
                        learning_rate=3e-3, save_every=0, offload_optimizer=True, dtype=config_name.split()[-1])
    return GRPOScheduler(model_dir, task.rewards, task.prompts, config,
                         engine_options={"enforce_eager": True} if quick else None)


def measure(model_dir: Path, params: int, config_name: str, device: str, quick: bool = False) -> dict:
    run = new_run(model_dir, config_name, quick)
    try:
        record = [run.train_step() for _ in range(2)][-1]
        # The usual way's trainer keeps its own copy of the weights.
        outside = 0 if config_name.startswith("colo") else tensor_bytes(run.model.parameters())
        dtype = record["dtype"]
    finally:
        run.close()
        del run
        gc.collect()
    row = {"section": SECTION, "case": f"{config_name} ({dtype} engine)", "device": device, "params": params,
           "trainer_weights_outside_pool_bytes": outside}
    for name, phase in PHASES.items():
        regions = {r: record.get(f"{r}_resident_bytes_during_{phase}", 0) for r in REGIONS}
        row[f"bytes_per_param_{name}"] = (sum(regions.values()) + outside) / params
        for region, nbytes in regions.items():
            row[f"{region}_bytes_per_param_{name}"] = nbytes / params
        row[f"kv_cache_bytes_{name}"] = record.get(f"kv_cache_resident_bytes_during_{phase}", 0)
        row[f"rss_bytes_{name}"] = record.get(f"rss_resident_bytes_during_{phase}", 0)
    return row


def measure_size(name: str, progress, device: str = "cpu", quick: bool = False) -> list[dict]:
    """quick: engines not compiled and a smaller batch (QUICK_BATCH): the same bytes per parameter in the
    regions, a shorter run."""
    with tempfile.TemporaryDirectory(prefix="colo-memory-") as tmp:
        model_dir = Path(tmp) / "model"
        params = save_model(model_dir, name)
        rows = [measure(model_dir, params, config, device, quick) for config in progress(CONFIGS, name)]
    usual = rows[-1]
    planned = _planned_layouts(params)
    for config, row in zip(CONFIGS, rows):
        row["model"] = name
        for phase in ("generate", "train"):  # colo.plan's count for the same layout and size
            row[f"planned_bytes_per_param_{phase}"] = planned[config].phase_bytes(phase, activations=False) / params
        for phase in PHASES:
            row[f"usual_way_ratio_{phase}"] = usual[f"bytes_per_param_{phase}"] / max(row[f"bytes_per_param_{phase}"], 1e-9)
        row["note"] = ("bytes per parameter resident in weights+grads+optimizer regions (and, for the usual way, "
                       "the trainer's own weights) during each phase of the second GRPO step; usual_way_ratio_<phase> "
                       "= the usual way's bytes / this row's; planned_bytes_per_param_<phase>: python -m colo.plan's count of "
                       "the same layout (weights, gradients, optimizer state; no activations); colo rows offload the optimizer state while generating "
                       "as on a GPU (on a host pool the copy stays in RAM: see rss_bytes_<phase>)"
                       + (f"; quick run: engines not compiled, {QUICK_BATCH[0]} prompts x {QUICK_BATCH[1]} "
                          f"completions x {QUICK_BATCH[2]} tokens" if quick else ""))
        if row is usual:
            row["in_summary"] = False  # the colo rows' baseline
        else:  # the table's figure: while generating, where colo's layout frees room for the KV cache
            row.update(baseline="usual way, while generating", colo_figure=row["bytes_per_param_generate"],
                       baseline_figure=usual["bytes_per_param_generate"], figure_unit="B/param",
                       ratio=row["usual_way_ratio_generate"])
    return rows


def _planned_layouts(params: int) -> dict:
    from colo.plan import plan

    # max_num_seqs=0: the CPU engine measured here runs vLLM's V1 runner, which keeps no sampler buffers
    bf16, fp32 = (plan(params, 1, 1 << 50, dtype, max_num_seqs=0) for dtype in ("bf16", "fp32"))
    return {"colo bf16": bf16[0], "colo fp32": fp32[0], "usual way": bf16[1]}


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    def measure(device: str) -> list[dict]:
        return [row for name in (QUICK_SIZES if quick else FULL_SIZES)
                for row in measure_size(name, progress, device, quick=quick)]

    return rows_per_device(SECTION, "bytes per parameter", devices, engine_unavailable_reason, measure)
