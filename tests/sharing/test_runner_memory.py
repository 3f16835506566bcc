"""vLLM's Model Runner V2 allocates its sampler's max_num_seqs x vocab buffers in load_model, so in the
pool's weights region: colo.vllm_compat.runner_memory counts them, and colo.grpo's KV cache budget
leaves room for them (a pool too small says so before any engine starts, naming them)."""
from __future__ import annotations

import pytest

from colo.vllm_compat import runner_memory


def test_v2_is_a_gpus_default_where_triton_is_and_the_environment_decides_first(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert not runner_memory.uses_model_runner_v2("cpu")  # the CPU runner is V1's subclass
    monkeypatch.setattr(runner_memory.importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    assert runner_memory.uses_model_runner_v2("cuda")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not runner_memory.uses_model_runner_v2("cuda")
    assert runner_memory.sampler_buffer_bytes(151936, 512, "cuda") == 0
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert runner_memory.sampler_buffer_bytes(151936, 512, "cuda") == 339_789_824  # ~324 MiB
    assert runner_memory.sampler_buffer_bytes(151936, 512, "cpu") == 0


def test_the_kv_budget_leaves_room_for_the_runners_buffers(tmp_path, monkeypatch):
    from colo import vllm_compat
    from colo.errors import OutOfMemoryError
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model

    model_dir = build_toy_model(tmp_path / "model")
    task = ToyTask(512)
    seen = []

    def v2_sized(vocab, max_num_seqs, device_type):
        seen.append((vocab, max_num_seqs, device_type))
        return 1 << 50  # more than any pool here holds

    monkeypatch.setattr(vllm_compat, "sampler_buffer_bytes", v2_sized)
    with pytest.raises(OutOfMemoryError, match=r"the model runner's buffers \(1125899906842624 bytes\)"):
        GRPOScheduler(model_dir, task.rewards, task.prompts, GRPOConfig(prompts_per_step=2, num_generations=4))
    assert seen == [(512, 8, "cpu")]  # the toy's vocabulary, the step's sequences
