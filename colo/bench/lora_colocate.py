"""Section lora: GRPO with a LoRA adapter, colo against stock TRL + PEFT in colocate mode, on the same
model, prompts, batch and adapter (r=8, alpha=16, every linear layer of the blocks).

- stock TRL + PEFT: `trl.GRPOTrainer(..., peft_config=LoraConfig(...))` with its own vLLM engine: a
  second copy of the base in the engine, and each sync merges the adapter into the trainer's base,
  pushes every merged base weight through `load_weights` and unmerges. Where vLLM packed the CPU
  linears that push crashes (as in the trl section); the named F.linear variant then runs instead.
- colo.trl + PEFT: the same script with `from colo.trl import GRPOTrainer`: one copy of the base,
  PEFT's lora_A/lora_B are views of the engine's LoRA slot, a sync is 0 bytes.
- colo.grpo: `GRPOScheduler` with `lora_rank=8, lora_alpha=16` on the same batch.

Rows: TRL's step_time medians (as the trl section), the sync time and bytes per sync, the bytes of
the trainer's and the engine's parameters together (each storage once: one base or two), the KV
cache held while training, the process RSS, and for colo.grpo the pool's resident bytes per region
while generating and while training.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from .baselines import UPDATABLE_VARIANT, stock_update_refused
from .measure import in_fresh_process, ratio, rows_per_device
from .trl_colocate import (BATCH, SIZES, WARMUP, _unavailable_reason, build_model_dir, grpo_and_kernels, measured_sides,
                           phase_medians)

SECTION = "lora"
LORA = dict(r=8, lora_alpha=16, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
QUICK_SIZES, FULL_SIZES = ("qwen2-trl-0.4M",), ("qwen2-trl-0.4M", "qwen2-trl-0.36B")


def measure_size(name: str, quick: bool, progress, device: str = "cpu") -> list[dict]:
    steps, rounds = (3, 1) if quick else (4, 2)
    with tempfile.TemporaryDirectory(prefix="colo-lora-") as tmp:
        tmp = Path(tmp)
        params = build_model_dir(tmp / "model", SIZES[name])
        sides, refused = measured_sides(tmp / "model", tmp, WARMUP + steps, rounds, progress, name, LORA)
        baseline = "variant" if refused else "stock"
        grpo, kernels = in_fresh_process(grpo_and_kernels, tmp / "model", steps, LORA)
    merged = {side: {key: [v for run in runs for v in run[key]] for key in ("step_s", "sync_s", "phases")}
              for side, runs in sides.items()}
    colo, base = merged["colo"], merged[baseline]
    first = {side: runs[0] for side, runs in sides.items()}
    base_name = f"stock TRL + PEFT on {UPDATABLE_VARIANT}" if refused else "stock TRL + PEFT (vLLM default mode)"
    common = {"section": SECTION, "device": device, "model": name, "params": params,
              "lora": {k: v for k, v in LORA.items() if k != "task_type"}, "cpu_kernels": kernels,
              **{f"batch_{k}": v for k, v in BATCH.items()}, "steps_measured": len(colo["step_s"]),
              "baseline_engine_dtype": first[baseline]["engine_dtype"],
              "baseline_trainer_dtype": first[baseline]["trainer_dtype"],
              "baseline_sync_s": statistics.median(base["sync_s"]), "baseline_sync_bytes": first[baseline]["sync_bytes"],
              "baseline_weight_bytes": first[baseline]["weight_bytes"],
              "baseline_kv_cache_bytes_during_train": first[baseline]["kv_cache_bytes_during_train"],
              "baseline_rss_bytes": max(r["rss_bytes"] for r in sides[baseline]),
              **{f"baseline_{k}": v for k, v in phase_medians(base["phases"]).items()}}
    note = (f"TRL 1.16 GRPOTrainer + PEFT 0.21 LoRA, colocate mode, same script on both sides; medians of TRL's "
            f"step_time over {steps} steps after {WARMUP} warm-up steps, {rounds} alternating round(s); "
            "weight_bytes: the trainer's and the engine's parameters, each storage once")
    if refused:
        note += f"; stock TRL cannot run here: {stock_update_refused(kernels)}; it raised {refused[:300]}"
    colo_step, base_step = statistics.median(colo["step_s"]), statistics.median(base["step_s"])
    rows = [{**common, "case": f"LoRA step {name}: colo.trl + PEFT", "colo_s": colo_step, "baseline": base_name,
             "baseline_s": base_step, "ratio": ratio(base_step, colo_step),
             "colo_engine_dtype": first["colo"]["engine_dtype"], "colo_trainer_dtype": first["colo"]["trainer_dtype"],
             "colo_engine_dtype_why": first["colo"]["engine_dtype_why"],
             "colo_sync_s": statistics.median(colo["sync_s"]), "colo_sync_bytes": first["colo"]["sync_bytes"],
             "colo_weight_bytes": first["colo"]["weight_bytes"],
             "colo_kv_cache_bytes_during_train": first["colo"]["kv_cache_bytes_during_train"],
             "colo_rss_bytes": max(r["rss_bytes"] for r in sides["colo"]),
             **{f"colo_{k}": v for k, v in phase_medians(colo["phases"]).items()},
             "goal": "faster than stock TRL + PEFT, 0 bytes per sync",
             "goal_met": colo_step < base_step and first["colo"]["sync_bytes"] == 0, "note": note}]
    records = grpo["records"]
    grpo_step = statistics.median(grpo["step_s"])
    per_phase = {key: max(r.get(key, 0) for r in records) for key in records[-1]
                 if "_resident_bytes_during_" in key}
    rows.append({**common, "case": f"LoRA step {name}: colo.grpo scheduler", "colo_s": grpo_step,
                 "baseline": base_name, "baseline_s": base_step, "ratio": ratio(base_step, grpo_step),
                 "colo_engine_dtype": grpo["dtype"], "colo_sync_s": statistics.median(grpo["sync_s"]),
                 "colo_sync_bytes": max(r["publish_bytes_copied"] for r in records),
                 "colo_optimizer_state_bytes": records[-1].get("optimizer_state_bytes"),
                 **{f"colo_{k}": v for k, v in per_phase.items()},
                 "goal": "faster than stock TRL + PEFT, 0 bytes per sync",
                 "goal_met": grpo_step < base_step and all(r["publish_bytes_copied"] == 0 for r in records),
                 "note": "colo.grpo's GRPOScheduler (dtype auto, toy task, lora_rank 8, lora_alpha 16, the same "
                         "targets) with TRL's batch; TRL's step includes its own reward, logging and dataloader "
                         "work; colo_<region>_resident_bytes_during_<phase>: the pool's regions"})
    return rows


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    def measure(device: str) -> list[dict]:
        return [row for name in (QUICK_SIZES if quick else FULL_SIZES)
                for row in measure_size(name, quick, progress, device)]

    return rows_per_device(SECTION, "LoRA step", devices, _lora_unavailable_reason, measure)


def _lora_unavailable_reason(device: str) -> str:
    why = _unavailable_reason(device)
    if not why:
        try:
            import peft  # noqa: F401
        except ImportError as e:
            why = f"needs PEFT: pip install -e \".[trl]\" ({e})"
    return why
