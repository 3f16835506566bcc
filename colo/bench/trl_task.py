"""`python -m colo.bench.trl_task --json PATH [--model smollm2|gemma3]`: colo.trl against stock TRL on a
real task, phase by phase.

The script of issue 46: SmolLM2-135M-Instruct on chat arithmetic with a TRL-signature reward, 8 prompts
x 8 completions a step, at most 32 new tokens, lr 1e-5, TRL's fp32 model, `bf16=False` (`--bf16`: TRL's
bf16=True, as a TRL script is typed: colo.trl's engine then takes the dtype `auto` picks, stock vLLM the
checkpoint's), one micro-batch of 64, and no `vllm_max_model_length` (the model's own 8192 tokens, as a
user who sets nothing gets). `--model gemma3`: Gemma 3 270M (a base model, no chat template) on the same
problems as 4-shot plain text, at most 8 new tokens, scored by the first number it writes
(colo.grpo.arithmetic.first_number), lr 5e-6, `vllm_max_model_length` 256 (its own 32768 tokens of 18
layers would not fit the KV cache on 24 GiB).
With TRL's GRPOTrainer, colo.grpo's scheduler runs the same task too (run_grpo_side), as a third side in a
fresh process of its own, its step against the same baseline.
`--trainer rloo|distillation`: TRL's RLOOTrainer on the same batch, or its DistillationTrainer on 64
prompts a step, one completion each, the model its own teacher (trainer_inputs).
Each side runs in a fresh process, in turn (`--rounds N`: N times, each round starting with another side,
the medians over the rounds recorded); the phases are colo.bench.trl_colocate.PhaseClock's (the same wrappers
on both sides). Stock TRL runs on its F.linear variant where stock vLLM cannot take new weights
(colo.bench.baselines.UPDATABLE_VARIANT). The process imports colo first, so torch's tensors are on huge
pages on every side, stock TRL's too (docs/cpu-kinds.md). A record, not a test: minutes per side.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

def task(model: str) -> tuple:
    """(model directory, dataset rows, reward function, TRL settings) of the task for `model`."""
    from colo.grpo import arithmetic

    if model == "gemma3":
        from colo.gemma3 import gemma3_dir

        return (gemma3_dir(), arithmetic.few_shot(256, 0, 4), arithmetic.first_number,
                dict(max_completion_length=8, learning_rate=5e-6, vllm_max_model_length=256))
    from colo.grpo.rewards import math_reward
    from colo.smollm2 import smollm2_dir

    return smollm2_dir(), arithmetic.problems(256, 0), math_reward, dict(max_completion_length=32, learning_rate=1e-5)


# --trainer: TRL's trainer and its config, both of which colo.trl has
TRAINERS = {"grpo": ("GRPOConfig", "GRPOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer"),
            "distillation": ("DistillationConfig", "DistillationTrainer")}


def trainer_inputs(trainer_name: str, model_dir, reward) -> tuple[dict, dict]:
    """(the trainer's keyword arguments beyond model, dataset and config; its config's). TRL's
    distillation samples one completion per prompt and scores it by a teacher: here the model itself
    (no other model of its vocabulary is at hand), which costs what a same-sized teacher costs."""
    if trainer_name == "distillation":
        return {"teacher_model": str(model_dir)}, {}
    return {"reward_funcs": [reward]}, {"num_generations": 8}


def run_side(side: str, out: str, steps: int, model: str = "smollm2", bf16: bool = False,
             trainer_name: str = "grpo") -> dict:
    """One TRL run of `steps` steps (the first is a warm-up); median seconds per phase, colo's syncs, and
    TRL's own engine-against-trainer log-probability difference per step. bf16: TRL's `bf16=True` (the fp32
    model trained under bf16 autocast, as a TRL script is typed), else `bf16=False`."""
    import trl
    from datasets import Dataset

    from colo.vllm_compat.forced_kernels import forced_cpu_gemm

    from .trl_colocate import PhaseClock, phase_medians

    model_dir, rows, reward, settings = task(model)
    config_class, class_name = TRAINERS[trainer_name]
    inputs, group = trainer_inputs(trainer_name, model_dir, reward)
    args = getattr(trl, config_class)(output_dir=out, per_device_train_batch_size=64, max_steps=steps,
                          logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=bf16, seed=0,
                          disable_tqdm=True, use_vllm=True, vllm_mode="colocate", **group,
                          **settings)  # TRL's model dtype: fp32
    if side == "colo":
        import colo.trl

        trainer_class = getattr(colo.trl, class_name)
    else:
        trainer_class = getattr(trl, class_name)
    with forced_cpu_gemm("plain") if side == "stock-variant" else contextlib.nullcontext():
        trainer = trainer_class(model=str(model_dir), train_dataset=Dataset.from_list(rows), args=args, **inputs)
    clock = PhaseClock(trainer, side == "colo")
    flops = _count_train_flops(trainer, clock)
    trainer.train()
    measured = clock.steps[1:]
    result = phase_medians(measured)
    result["steps_measured"] = len(measured)
    result["engine_dtype"] = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    result["reward_per_step"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result["loss_per_step"] = [h["loss"] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    for name in ("mean", "max"):   # |TRL's log-probabilities - the engine's| of the sampled tokens, per step
        key = f"sampling/sampling_logp_difference/{name}"
        result[f"sampling_logp_difference_{name}"] = [h[key] for h in trainer.state.log_history if key in h]
    # The training's rate: forward and backward FLOPs of TRL's log-probability passes and loss over the
    # seconds of those phases (the optimizer step left out).
    result["train_flops_per_s"] = statistics.median(
        flops.get(i + 1, 0.0) / (step["logprob_passes"] + step.get("loss", 0.0) + step["backward"])
        for i, step in enumerate(measured))
    if side == "colo":
        reports = trainer.vllm_generation.colo_sync_reports[1:]
        result.update(sync_bytes_copied=max(r["bytes_copied"] for r in reports),
                      sync_bytes_repacked=max(r["bytes_repacked"] for r in reports),
                      publish_s=statistics.median(r["seconds"] for r in reports))
    return result


def over_rounds(results: list[dict]) -> dict:
    """One side's rounds as one: each number the median over the rounds, the rest the first round's, and
    every round's results under "rounds" (more than one)."""
    def merged_value(key, value):
        values = [r[key] for r in results]
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        return statistics.median(values) if numeric and len(set(values)) > 1 else value

    merged = {key: merged_value(key, value) for key, value in results[0].items()}
    return {**merged, "rounds": results} if len(results) > 1 else merged


def run_grpo_side(out: str, steps: int, model: str = "smollm2") -> dict:
    """colo.grpo's scheduler on the same task, batch and settings (prompts, reward, 8 x 8 completions, new
    tokens, learning rate, seed; the dtype `auto` picks, as `python -m colo.grpo` without `--dtype`; the engine's
    model length its own fit): the median over the steps after the first of each phase's seconds its records
    give, each step's seconds, rewards and loss."""
    from colo.grpo import GRPOConfig, GRPOScheduler

    model_dir, rows, reward, settings = task(model)
    config = GRPOConfig(prompts_per_step=8, num_generations=8, max_new_tokens=settings["max_completion_length"],
                        learning_rate=settings["learning_rate"], seed=0)
    run = GRPOScheduler(model_dir, config=config, dataset=rows, reward_funcs=[reward], out_dir=out)
    try:
        records = run.run(steps, progress=False)
    finally:
        run.close()
    measured = records[1:]
    result = {name: statistics.median(r[key] for r in measured)
              for name, key in (("wall_s", "step_s"), ("generate_s", "generate_s"), ("train_s", "train_s"),
                                ("publish_s", "publish_s"), ("rewards_s", "reward_s"))}
    result.update(steps_measured=len(measured), engine_dtype=records[0]["dtype"],
                  step_s_per_step=[r["step_s"] for r in records], train_s_per_step=[r["train_s"] for r in records],
                  reward_per_step=[r["reward_mean"] for r in records], loss_per_step=[r["loss"] for r in records],
                  publish_bytes_copied=max(r["publish_bytes_copied"] for r in records))
    return result


def _count_train_flops(trainer, clock) -> dict[int, float]:
    """{step index: matmul FLOPs of TRL's model passes}, counted from the shapes TRL gives them
    (colo.bench.trl_colocate.model_passes): the body on every position, the head on the kept ones; x2 a
    forward, x3 with its backward (grad enabled). Attention's products are left out (an understatement)."""
    import torch

    from .measure import matmul_parameters
    from .trl_colocate import model_passes

    config = trainer.accelerator.unwrap_model(trainer.model).config
    head = config.hidden_size * config.vocab_size
    body = matmul_parameters(config) - head
    flops: dict[int, float] = {}
    name = model_passes(trainer)   # (distillation: the head runs in its loss, on the same kept positions)
    passes = getattr(trainer, name)

    def counted(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        rows = input_ids.shape[0]
        forward = 2 * (body * input_ids.numel() + head * rows * logits_to_keep)
        step = len(clock.steps)
        flops[step] = flops.get(step, 0.0) + forward * (3 if torch.is_grad_enabled() else 1)
        return passes(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    setattr(trainer, name, counted)
    return flops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colo.bench.trl_task", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per side, the first a warm-up (default 4)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the record")
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2",
                        help="SmolLM2-135M-Instruct on chat arithmetic (default), or Gemma 3 270M on 4-shot arithmetic")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each side, in turn, each round starting with another side; the figures are "
                             "the medians over the rounds (default 1)")
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16=True on both sides (default: bf16=False)")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="grpo",
                        help="TRL's GRPOTrainer (default), RLOOTrainer or DistillationTrainer (the model its own "
                             "teacher), with TRL's defaults for the rest")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is a warm-up)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    import torch

    from .baselines import stock_update_refused
    from .machine import machine_info
    from .measure import gemm_peak_flops, in_fresh_process
    from .trl_colocate import kernels_of

    kernels = in_fresh_process(kernels_of, task(args.model)[0], "float32")
    baseline = "stock-variant" if stock_update_refused(kernels) else "stock"
    started = time.time()
    names = ["colo", baseline, *(["colo.grpo"] if args.trainer == "grpo" else [])]
    rounds: dict[str, list] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="colo-trl-task-") as tmp:
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:  # each round starts with another side
                out = f"{tmp}/{name}{i}"
                result = in_fresh_process(run_grpo_side, out, args.steps, args.model) if name == "colo.grpo" else \
                    in_fresh_process(run_side, name, out, args.steps, args.model, args.bf16, args.trainer)
                rounds[name].append(result)
                print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}, file=sys.stderr,
                      flush=True)
    sides = {name: over_rounds(results) for name, results in rounds.items()}
    grpo = sides.pop("colo.grpo", None)
    peak_dtype = torch.bfloat16 if args.bf16 else torch.float32  # what TRL's autocast trains in
    peak = gemm_peak_flops(peak_dtype)
    for values in sides.values():
        values["train_vs_gemm_peak"] = values["train_flops_per_s"] / peak
    colo, base = sides["colo"], sides[baseline]
    train_and_sync = {name: s["wall_s"] - s["generate_s"] for name, s in sides.items()}
    record = {
        "command": "python -m colo.bench.trl_task " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": args.model, "trainer": args.trainer, "bf16": args.bf16, "cpu_kernels": kernels, "baseline": baseline,
        "sides": sides,
        "train_and_sync_s": train_and_sync,
        "train_and_sync_vs_baseline": train_and_sync["colo"] / train_and_sync[baseline],
        "step_vs_baseline": colo["wall_s"] / base["wall_s"], "gemm_peak_flops_per_s": peak,
        **({"colo.grpo": grpo, "colo.grpo_step_vs_baseline": grpo["wall_s"] / base["wall_s"]} if grpo else {}),
        "gemm_peak_dtype": str(peak_dtype).removeprefix("torch."),
        "seconds": time.time() - started,
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
