"""`python -m colo.grpo` on a real model and a user's task, end to end: SmolLM2-135M-Instruct (real
tokenizer, ChatML template, EOS, 49k vocabulary) on the arithmetic dataset colo.grpo.arithmetic
writes, with the built-in math reward and a reward file in TRL's signature. Completions stop at EOS,
the record has what issue 33 asks for, the engine samples with the weights being trained, and a
reward that raises mid-run stops the run naming it, leaving the last checkpoint resumable."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers.forked import run_python
from helpers.logprobs import assert_engine_follows

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 12
FLAKY = '''import os
scored = 0

def flaky(prompts, completions, completion_ids, answer, **kwargs):
    """Rewards short answers; once it has seen RAISE_AFTER completions it raises (a service it needs
    went down). Counted in completions, not calls: an overlapped step scores each group on its own."""
    global scored
    scored += len(completion_ids)
    if scored > int(os.environ.get("RAISE_AFTER") or 10**9):
        raise RuntimeError("the user's reward broke")
    return [1.0 if len(ids) <= 6 else 0.0 for ids in completion_ids]
'''


def run(out: Path, *extra: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    args = ["--json", str(out / "log.jsonl"), "--out", str(out), "--no-progress", "--eager", *extra]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env_extra or {})}
    return run_python("colo.grpo", args, env, cwd=REPO, timeout=600)


def test_real_model_on_a_dataset_stops_at_eos_and_resumes_after_a_failing_reward(smollm2_model_dir, tmp_path):
    from colo.dtype_choice import fastest_dtype
    from colo.grpo.arithmetic import write

    train, evaluation = write(tmp_path / "data", train=16, eval=4)
    reward_file = tmp_path / "my_rewards.py"
    reward_file.write_text(FLAKY)
    out = tmp_path / "run"
    flags = ["--steps", "2", "--model", str(smollm2_model_dir), "--dataset", str(train), "--reward", "math",
             "--reward", f"{reward_file}:flaky", "--reward-weights", "1", "0.5", "--eval-dataset", str(evaluation),
             "--eval-every", "2", "--eval-on-start", "--prompts-per-step", "2", "--num-generations", "4",
             "--max-new-tokens", str(MAX_NEW),
             "--lr", "1e-5", "--save-every", "1"]   # in the dtype --dtype auto picks here, as a user gets
    # the base model's evaluation scores the 4 eval completions, step 1 its 8; step 2 raises
    failed = run(out, *flags, env_extra={"RAISE_AFTER": "12"})
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert "reward function 'flaky' raised RuntimeError: the user's reward broke at step 2, on dataset row" in \
        failed.stderr and "(completion 0 of the " in failed.stderr, failed.stderr[-2000:]
    assert sorted(p.name for p in out.glob("step-*.pt")) == ["step-000001.pt"]

    resumed = run(out, "--steps", "2", "--resume")  # the user fixed the reward; same data and rewards (run.json)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    # the base model's evaluation (step 0), once: the resumed run did not repeat it
    assert [r["step"] for r in log] == [0, 1, 2] and "reward_mean" not in log[0]
    assert 0 <= log[0]["eval/math"] <= 1
    for r in log[1:]:
        assert set(r) >= {"rewards/math/mean", "rewards/math/std", "rewards/flaky/mean", "rewards/flaky/std",
                          "completion_length_mean", "clipped_ratio", "tokens_per_s", "engine_logprob_mean_abs_diff"}
        assert 0 <= r["rewards/math/mean"] <= 1 and 0 <= r["clipped_ratio"] <= 1
        assert r["reward_mean"] == pytest.approx(r["rewards/math/mean"] + 0.5 * r["rewards/flaky/mean"], abs=1e-9)
        assert 1 <= r["completion_length_min"] <= r["completion_length_mean"] <= r["completion_length_max"] <= MAX_NEW
        assert r["dtype"] == fastest_dtype("cpu").name
        assert_engine_follows(r)
        assert r["publish_bytes_copied"] == 0
    # SmolLM2 answers "Answer with the number only" in a few tokens and ends its turn: EOS stops it.
    assert min(r["completion_length_min"] for r in log[1:]) < MAX_NEW
    assert any(r["clipped_ratio"] < 1 for r in log[1:])
    assert 0 <= log[2]["eval/math"] <= 1 and "eval/flaky" in log[2]


def test_truncated_completions_left_out_of_the_loss(tmp_path):
    """The toy task ignores EOS, so every completion runs to max_new_tokens: all are truncated
    (clipped_ratio 1), and with mask_truncated none counts in the loss: zero loss and gradient, weights
    unchanged; without it the same step has a gradient. (In this process: the CLI's --mask-truncated is
    the config's, tests/grpo/test_grpo_task.py.)"""
    import torch

    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model

    model_dir, task = build_toy_model(tmp_path / "model"), ToyTask(512)
    records = {}
    for masked in (True, False):
        config = GRPOConfig(prompts_per_step=2, num_generations=4, max_new_tokens=8, ignore_eos=True, dtype="fp32",
                            learning_rate=3e-3, save_every=0, mask_truncated=masked)
        run = GRPOScheduler(model_dir, task.rewards, task.prompts, config, engine_options={"enforce_eager": True})
        try:
            before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
            records[masked] = run.train_step()
            unchanged = all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
        finally:
            run.close()
        assert records[masked]["clipped_ratio"] == 1.0
        assert unchanged == masked
    assert records[True]["grad_norm"] == 0.0 and records[True]["loss"] == 0.0
    assert records[False]["grad_norm"] > 0.0
