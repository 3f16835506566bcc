"""TRL's GRPO on a tiny vision-language model, two steps on 16 image rows, stock TRL or colo.trl (the
same script, one import changed); as a script, stock TRL in a process of its own (a user's), its
results written as JSON: stock vLLM's CPU worker sizes its KV cache as a fraction of the machine's
memory less this process's resident memory, which a test worker's earlier engines leave too large.

    python tests/helpers/trl_vision_runs.py MODEL_DIR OUT_DIR   # writes OUT_DIR/stock.json
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path

import torch
import trl

if __name__ == "__main__":   # a script: tests/ on the path, as conftest.py puts it there for the tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.images import squares  # noqa: E402
from helpers.spies import count_calls  # noqa: E402

from colo.vllm_compat.forced_kernels import forced_cpu_gemm  # noqa: E402


def run(side: str, model_dir, tmp_path):
    """Two TRL steps on 16 image rows; what the reward function saw and the trainer."""
    import datasets

    trainer_class = trl.GRPOTrainer
    if side == "colo":
        from colo.trl import GRPOTrainer as trainer_class
    rows = [{"prompt": [{"role": "user", "content": "How many squares?"}], "image": squares(i % 4 + 1)}
            for i in range(16)]
    seen = []

    def first_token_parity(prompts, completion_ids, image, **kwargs):
        seen.extend(i.tobytes() for i in image)
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]

    args = trl.GRPOConfig(output_dir=str(tmp_path / side), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-2,
                          vllm_max_model_length=128, save_strategy="no", use_cpu=True, bf16=False, seed=0,
                          use_vllm=True, vllm_mode="colocate")
    # Stock vLLM packs fp32 linears into oneDNN's layout where its build takes them (AVX-512 CPUs), and then
    # stock TRL's weight sync has nowhere to load into: stock TRL runs on the F.linear variant there.
    with forced_cpu_gemm("plain") if side == "stock" else contextlib.nullcontext():
        trainer = trainer_class(model=str(model_dir), reward_funcs=first_token_parity,
                                train_dataset=datasets.Dataset.from_list(rows), args=args)
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if side == "colo":
        from colo.vllm_compat import engine_model

        trainer.colo_test_loads = count_calls(engine_model(trainer.vllm_generation.llm), "load_weights")
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p)}
    return trainer, history, seen, changed


def stock_in_own_process(model_dir, tmp_path, timeout: float = 600) -> tuple[list[dict], list[str]]:
    """Stock TRL's log history (the steps' records) and the sha1 of each image its reward function saw,
    run in a fresh process (helpers.forked)."""
    import os

    from conftest import free_port
    from helpers.forked import run_python

    # (no rank variables another test's stock TRL may have left: TRL's colocate engine sets them)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    done = run_python(__file__, [model_dir, tmp_path], {**env, "MASTER_PORT": str(free_port())}, cwd=Path(tmp_path),
                      timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"stock TRL's run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads((Path(tmp_path) / "stock.json").read_text())
    return result["history"], result["seen"]


def image_digests(seen: list[bytes]) -> list[str]:
    return [hashlib.sha1(image).hexdigest() for image in seen]


if __name__ == "__main__":
    _, history, seen, _ = run("stock", sys.argv[1], Path(sys.argv[2]))
    (Path(sys.argv[2]) / "stock.json").write_text(json.dumps({"history": history, "seen": image_digests(seen)}))
