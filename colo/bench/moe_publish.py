"""Section moe_publish: the publish section (colo.bench.publish) on a MoE model, full run only.

A random 0.50B Qwen3-MoE (16 layers of 32 experts of width 384, 4 per token; transformers 5 stores each
layer's experts as the fused `gate_up_proj` / `down_proj` vLLM's FusedMoE holds as `w13_weight` /
`w2_weight`): colo's `publish()`, the trainer's experts views of the engine's, against TRL's sync
(`load_weights` per parameter on a stock engine), rebuilding the engine, and colo's bucketed copy; and
generation through the shared weights against stock vLLM.
"""
from __future__ import annotations

import logging

from .measure import engine_unavailable_reason, rows_per_device
from .publish import measure_size

SECTION = "moe_publish"
SIZE = "qwen3moe-0.5B"   # colo.bench.models.MOE_SIZES


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    def measure(device: str) -> list[dict]:
        vllm_logger = logging.getLogger("vllm")
        level = vllm_logger.level
        vllm_logger.setLevel(logging.ERROR)
        try:
            return [{**row, "section": SECTION} for row in measure_size(SIZE, quick, progress, device)]
        finally:
            vllm_logger.setLevel(level)

    return rows_per_device(SECTION, "publish", devices, engine_unavailable_reason, measure)
