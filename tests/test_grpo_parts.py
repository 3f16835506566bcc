"""The GRPO scheduler's parts that need no engine: checkpoints, logs, timeline, batching,
training memory in the pool, the toy task and the command line's argument checks (fast)."""
import copy
import json

import pytest
import torch

import colo
from colo.grpo import cli
from colo.grpo.batch import completion_logprobs, pack
from colo.grpo.checkpoint import (CheckpointError, capture_rng, latest_checkpoint, list_checkpoints,
                                  load_checkpoint, restore_rng, save_checkpoint)
from colo.grpo.config import GRPOConfig
from colo.grpo.metrics import StepLog, Timeline
from colo.grpo.toy_task import ToyTask
from colo.grpo.phases import MemoryPhases
from colo.grpo.train_memory import TrainingMemory


def _state(value=1.0):
    return {"model": {"w": torch.full((3,), value)}, "optimizer": {}, "rng": [capture_rng()], "config": {}}


def test_checkpoints_are_atomic_numbered_and_pruned(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    # A run killed mid-write leaves a .tmp file: never picked up, and removed by the next save.
    (tmp_path / "step-000009.pt.tmp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step-000003.pt"
    save_checkpoint(tmp_path, 4, _state(4), keep=2)
    assert not list(tmp_path.glob("*.tmp"))
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 4 and state["model"]["w"].tolist() == [4.0, 4.0, 4.0]


def test_unreadable_or_foreign_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "step-000001.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="is not a colo GRPO checkpoint .step-N.pt., or is damaged"):
        load_checkpoint(bad)
    torch.save({"something": "else"}, tmp_path / "step-000002.pt")
    with pytest.raises(CheckpointError, match="not a colo GRPO checkpoint"):
        load_checkpoint(tmp_path / "step-000002.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")


def test_rng_state_round_trips():
    state = capture_rng()
    expected = (torch.rand(3), __import__("random").random())
    torch.rand(5)
    restore_rng(state)
    assert torch.equal(torch.rand(3), expected[0]) and __import__("random").random() == expected[1]


def test_step_log_drops_records_past_the_resumed_checkpoint(tmp_path):
    path = tmp_path / "log.jsonl"
    log = StepLog(path)
    for step in range(1, 6):
        log.write({"step": step})
    with open(path, "a") as f:
        f.write('{"step": 6, "rew')  # the half-written line of a killed run
    StepLog(path, resume_after_step=3).write({"step": 4, "again": True})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["again"]


def test_timeline_is_a_chrome_trace_closed_killed_or_resumed(tmp_path):
    path = tmp_path / "trace.json"
    tl = Timeline(path, rank=0)
    with tl.span("generate", step=1) as span:
        pass
    tl.counter("resident_bytes", {"kv_cache": 5})
    # A killed run leaves the array open: the format allows it, readers close it.
    events = json.loads(path.read_text().rstrip().rstrip(",") + "]")
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans[0]["name"] == "generate" and spans[0]["dur"] >= 0 and span["seconds"] >= 0
    assert any(e.get("ph") == "C" and e["args"] == {"kv_cache": 5} for e in events)
    tl.close()
    assert len(json.loads(path.read_text())) == len(events) + 1  # strict JSON once closed
    resumed = Timeline(path, rank=0, append=True)
    with resumed.span("train", step=2):
        pass
    resumed.close()
    names = [e["name"] for e in json.loads(path.read_text()) if e.get("ph") == "X"]
    assert names == ["generate", "train"]


def test_toy_task_rewards_and_deterministic_prompts():
    task = ToyTask(vocab_size=64, prompt_len=5, modulus=4, seed=3)
    assert task.prompts(7, 4) == task.prompts(7, 4) != task.prompts(8, 4)
    assert all(len(p) == 5 and all(0 <= t < 64 for t in p) for p in task.prompts(1, 10))
    assert task.rewards([[1]] * 3, [[0, 4, 8, 1], [1, 2, 3], []]) == [0.75, 0.0, 0.0]


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).float()


def test_packed_batch_logprobs_match_each_sequence_alone():
    model = _tiny_model()
    prompts, completions = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]]
    batch = pack(prompts, completions)
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    together = completion_logprobs(model, batch, temperature=0.5)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1] / 0.5
        alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(together[row, :len(c)], alone, atol=1e-5)
    with pytest.raises(ValueError, match="prompts but"):
        pack(prompts, completions[:1])


class _KvCacheOnly:
    """What colo.grpo.phases.MemoryPhases asks of an engine: a KV cache that sleeps and wakes."""

    def __init__(self, pool):
        self.region = pool.region("kv_cache", budget=1 << 20)

    @property
    def kv_cache_asleep(self):
        return self.region.asleep

    def sleep_kv_cache(self):
        self.region.sleep(offload=False)

    def wake_kv_cache(self):
        self.region.wake()


def test_memory_phases_release_gradients_before_the_copy_out_and_wake_the_kv_cache_last():
    """The order to_generate() keeps: gradients asleep before the optimizer state's copy out starts, the
    copy done before the KV cache wakes; and optimizer_state_in_reach() puts everything back as it was."""
    model = _tiny_model()
    pool = colo.Pool("cpu", capacity=1 << 30)
    memory = TrainingMemory(pool, list(model.parameters()), offload_optimizer=True)
    optimizer = memory.build_optimizer(torch.optim.AdamW, lr=1e-2)
    engine = _KvCacheOnly(pool)
    phases = MemoryPhases(engine, memory, on=True)
    phases.to_train()
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    memory.adopt_optimizer_state(optimizer)
    seen = []
    phases.to_generate(overlapping=lambda: seen.append((memory.grads.asleep, memory.optimizer_state_away,
                                                        engine.kv_cache_asleep)))
    assert seen == [(True, True, True)]
    assert not engine.kv_cache_asleep and memory.optimizer_region.asleep
    with phases.optimizer_state_in_reach():
        assert not memory.optimizer_state_away
    assert memory.optimizer_region.asleep and not engine.kv_cache_asleep
    off = MemoryPhases(engine, memory, on=False)  # memory phases off: nothing sleeps, gradients are zeroed
    memory.wake_gradients()
    memory.flat_grads[torch.float32].fill_(1.0)
    off.to_train()
    assert not engine.kv_cache_asleep and float(memory.flat_grads[torch.float32].abs().sum()) == 0


def test_training_memory_gradients_and_offloaded_optimizer_state_live_in_the_pool():
    model = _tiny_model()
    params = list(model.parameters())
    pool = colo.Pool("cpu", capacity=1 << 30)
    memory = TrainingMemory(pool, params, offload_optimizer=True)
    optimizer = memory.build_optimizer(torch.optim.AdamW, lr=1e-2)
    assert type(optimizer) is torch.optim.AdamW  # fp32 parameters: no master weights
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    memory.check_grads_attached()
    assert all(memory.grads.contains(p.grad) for p in params)
    optimizer.step()
    memory.adopt_optimizer_state(optimizer)
    moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in params]
    assert all(memory.optimizer_region.contains(optimizer.state[p]["exp_avg"]) for p in params)

    engine = _KvCacheOnly(pool)
    phases = MemoryPhases(engine, memory, on=True)
    copied_out_during = phases.to_generate(overlapping=lambda: memory.optimizer_state_away)
    assert copied_out_during  # the publish runs while the optimizer state's copy out is in flight
    stats = pool.stats()
    assert stats["grads"]["resident_bytes"] == 0 and stats["optimizer"]["resident_bytes"] == 0
    assert not engine.kv_cache_asleep  # ready to generate
    assert phases.to_generate() is None and phases.take_seconds() > 0  # a second call finds it done

    phases.to_train()
    assert engine.kv_cache_asleep
    memory.finish_prefetch()
    assert all(torch.equal(optimizer.state[p]["exp_avg_sq"], m) for p, m in zip(params, moments))
    assert all(float(p.grad.abs().sum()) == 0 for p in params)  # gradients start from zero each step
    p0 = params[0]
    p0.grad = None
    with pytest.raises(RuntimeError, match="no longer a view"):
        memory.check_grads_attached()


def test_bf16_training_memory_keeps_fp32_masters_and_main_grads_in_the_pool():
    model = _tiny_model().to(torch.bfloat16)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    pool = colo.Pool("cpu", capacity=1 << 30)
    memory = TrainingMemory(pool, params, offload_optimizer=True)
    optimizer = memory.build_optimizer(torch.optim.AdamW, lr=1e-2)
    assert memory.grads.budget >= 4 * numel and memory.optimizer_region.budget >= 12 * numel
    assert memory.optimizer_region.contains(optimizer.master_flat) and memory.grads.contains(optimizer.grad_flat)
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None for p in params)  # added into the fp32 main gradients, then dropped
    assert float(memory.flat_grads[torch.float32].abs().sum()) > 0
    optimizer.step()
    memory.adopt_optimizer_state(optimizer)
    state = optimizer.state_dict()
    phases = MemoryPhases(_KvCacheOnly(pool), memory, on=True)
    phases.to_generate()  # masters and moments offloaded, gradients released
    assert pool.stats()["optimizer"]["resident_bytes"] == 0 and pool.stats()["grads"]["resident_bytes"] == 0
    phases.to_train()
    memory.finish_prefetch()
    torch.testing.assert_close(optimizer.master_flat, state["master_weights"], atol=0, rtol=0)
    for p, master in zip(params, optimizer.masters):
        assert torch.equal(p, master.to(torch.bfloat16))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_generations"):
        GRPOConfig(num_generations=0)
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0.0)
    with pytest.raises(ValueError, match="offload_optimizer"):
        GRPOConfig(offload_optimizer="yes")
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp32"):
        GRPOConfig(dtype="float16")
    assert GRPOConfig(dtype="fp32").resolve_dtype("unused").dtype == "fp32"
    assert GRPOConfig.from_dict(GRPOConfig(seed=4).to_dict()) == GRPOConfig(seed=4)
    assert GRPOConfig.from_dict(GRPOConfig(offload_optimizer=True).to_dict()).offload_optimizer is True
    for bad in (3, (1, 2, 3), "1,2", (0, 1), (1.5, 1)):
        with pytest.raises(ValueError, match="overlap_threads must be"):
            GRPOConfig(overlap_threads=bad)
    # A run's config is saved as JSON (a list) and read back as the pair.
    saved = json.loads(json.dumps(GRPOConfig(overlap_threads=(1, 2)).to_dict()))
    assert GRPOConfig.from_dict(saved).overlap_threads == (1, 2)


def _cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_cli_bad_arguments_fail_fast_with_a_message(tmp_path, capsys):
    base = ["--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out")]
    assert "must be at least 1" in _cli_error(capsys, ["--steps", "0", *base])
    assert "positive integer" in _cli_error(capsys, ["--steps", "x", *base])
    assert "ENGINE,TRAINER" in _cli_error(capsys, ["--steps", "3", "--overlap-threads", "2", *base])
    assert "must be at least 1" in _cli_error(capsys, ["--steps", "3", "--overlap-threads", "1,0", *base])
    assert "no such directory" in _cli_error(capsys, ["--steps", "3", "--model", str(tmp_path / "missing"), *base])
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _cli_error(capsys, ["--steps", "3", "--model", str(tmp_path / "empty"), *base])
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert "does not support the architecture GPT2LMHeadModel" in _cli_error(
        capsys, ["--steps", "3", "--model", str(tmp_path / "gpt2"), *base])
    assert "run.json" in _cli_error(capsys, ["--steps", "3", "--resume", *base])
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"model_dir": str(tmp_path), "config": {}}))
    (out / "step-000002.pt").write_bytes(b"garbage")
    assert "is not a colo GRPO checkpoint (step-N.pt), or is damaged" in _cli_error(capsys, ["--steps", "3", "--resume", *base])
    # A new run must not overwrite the checkpoints of another.
    assert "already holds checkpoints" in _cli_error(capsys, ["--steps", "3", *base])


def test_micro_batches_add_up_to_the_whole_batch_gradient():
    from colo.grpo.loss import group_advantages
    from colo.grpo.backward import accumulate_gradients

    model = _tiny_model()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    completions = [[11, 12, 13, 14], [15], [16, 17], [18, 19, 20]]
    batch = pack(prompts, completions)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25]), group_size=2)
    tokens = float(batch.completion_mask.sum())

    def gradient(micro_batch_size, beta=0.0, reference=None):
        model.zero_grad(set_to_none=True)
        cfg = GRPOConfig(micro_batch_size=micro_batch_size, beta=beta, temperature=0.8)
        stats = accumulate_gradients(model, batch, advantages, cfg, num_tokens=tokens, reference=reference)
        return torch.cat([p.grad.flatten() for p in model.parameters()]), stats

    whole, whole_stats = gradient(None)
    pieces, piece_stats = gradient(1)
    assert whole.abs().sum() > 0
    assert torch.allclose(whole, pieces, atol=1e-6)
    assert piece_stats["loss"] == pytest.approx(whole_stats["loss"], abs=1e-6)
    # With a KL term against a different reference the loss moves, and still adds up.
    reference = _tiny_model()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01)
    kl_whole, kl_stats = gradient(None, beta=0.1, reference=reference)
    kl_pieces, _ = gradient(3, beta=0.1, reference=reference)
    assert kl_stats["kl"] > 0 and not torch.allclose(kl_whole, whole)
    assert torch.allclose(kl_whole, kl_pieces, atol=1e-6)


def test_scheduler_refuses_an_unsupported_architecture_before_starting_an_engine(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    from colo.grpo import scheduler as scheduler_module

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).save_pretrained(tmp_path)
    started = []
    monkeypatch.setattr(scheduler_module, "RolloutEngine", lambda *a, **k: started.append(1))
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel"):
        scheduler_module.GRPOScheduler(tmp_path, lambda p, c: [0.0] * len(c), lambda step, n: [[1, 2]] * n)
    assert not started


def test_a_gpu_rank_sets_its_device_before_joining_nccl_and_names_it(monkeypatch):
    """Under torchrun each rank's device is LOCAL_RANK, made current before the process group (and any
    barrier) exists and given to NCCL as device_id, so nothing falls back to cuda:0."""
    from colo.grpo import distributed as D

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(D.dist, "is_initialized", lambda: bool(calls) and calls[-1][0] == "init")
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(D.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(D.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(D.dist, "get_world_size", lambda: 2)
    world = D.init_world("cuda")
    assert calls == [("set_device", 1), ("init", "nccl", {"device_id": torch.device("cuda", 1)})]
    assert world == D.World(rank=1, size=2, local_rank=1, device="cuda:1")


_LEAVE_WORLD_SCRIPT = """
import os
import torch.distributed as dist
from colo.grpo import distributed as D

def one_rank_group(*args, **kwargs):
    init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

init_process_group = dist.init_process_group
one_rank_group()  # a caller's own group: init_world joins it, leave_world leaves it alone
assert D.init_world("cpu") == D.World(rank=0, size=1, local_rank=0)
D.leave_world()
assert dist.is_initialized()
dist.destroy_process_group()

os.environ["WORLD_SIZE"] = "2"  # as under torchrun; the group itself is a one-rank one
dist.init_process_group = one_rank_group
D.init_world("cpu")
assert dist.is_initialized()
D.leave_world()
assert not dist.is_initialized()
D.leave_world()  # twice is harmless
print("leave_world ok")
"""


def test_leave_world_destroys_the_group_init_world_started_and_no_other():
    # In a fresh process: torch.distributed's default group is per process, and an engine built by an
    # earlier test in this one may hold it.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _LEAVE_WORLD_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "leave_world ok" in run.stdout, run.stderr[-2000:]


def test_cuda_pool_means_the_current_device(monkeypatch):
    from colo import pool as pool_module

    monkeypatch.setattr(pool_module, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert pool_module._parse_device("cuda") == torch.device("cuda", 3)
    assert pool_module._parse_device("cuda:1") == torch.device("cuda", 1)


def test_optimizer_state_is_offloaded_only_where_the_pool_needs_it_and_without_waiting():
    model = _tiny_model()
    params = list(model.parameters())
    state_bytes = 2 * sum(p.numel() * 4 for p in params)
    roomy = colo.Pool("cpu", capacity=1 << 30)
    assert not TrainingMemory(roomy, params).offload_optimizer  # auto: it fits beside the engine's regions
    tight = colo.Pool("cpu", capacity=64 << 20)
    kv = tight.region("kv_cache", budget=(64 << 20) - state_bytes - (1 << 20))  # the engine leaves too little
    kv.sleep()  # as the scheduler does while the training memory is made
    memory = TrainingMemory(tight, params)
    assert memory.offload_optimizer

    optimizer = memory.build_optimizer(torch.optim.AdamW, lr=1e-2)
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    memory.adopt_optimizer_state(optimizer)
    moments = [optimizer.state[p]["exp_avg"].clone() for p in params]
    memory.start_offload()  # returns at once; the copy runs on the copy stream
    assert not memory.optimizer_region.asleep
    memory.finish_offload()
    assert memory.optimizer_region.asleep and memory.optimizer_region.stats()["resident_bytes"] == 0
    memory.finish_prefetch()
    assert all(torch.equal(optimizer.state[p]["exp_avg"], m) for p, m in zip(params, moments))


def test_state_replaced_while_its_offload_is_in_flight_is_what_comes_back():
    """A checkpoint restored between start_offload() and finish_offload() (as a resumed run does) must
    not be overwritten by the stale copy that was on its way out."""
    model = _tiny_model()
    params = list(model.parameters())
    memory = TrainingMemory(colo.Pool("cpu", capacity=1 << 30), params, offload_optimizer=True)
    optimizer = memory.build_optimizer(torch.optim.AdamW, lr=1e-2)
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    memory.adopt_optimizer_state(optimizer)
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.step()  # the state moves on; then the run is "restored" to `saved`
    memory.start_offload()
    memory.finish_prefetch()  # what restoring does first
    optimizer.load_state_dict(saved)
    memory.adopt_optimizer_state(optimizer)
    memory.offload_optimizer_state()
    memory.finish_prefetch()
    for index, p in enumerate(params):
        assert torch.equal(optimizer.state[p]["exp_avg"], saved["state"][index]["exp_avg"])


def test_each_tensor_parallel_rank_holds_its_share_of_the_kv_heads():
    """The KV cache is sized per rank: its share of the KV heads, or one head that vLLM replicates
    when there are fewer KV heads than ranks."""
    from transformers import Qwen2Config

    from colo.grpo.rollout_engine import kv_bytes_per_token

    config = Qwen2Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3)
    whole = kv_bytes_per_token(config, torch.bfloat16)
    assert whole == 2 * 3 * 4 * 32 * 2  # K and V, layers, KV heads, head_dim, bytes
    assert kv_bytes_per_token(config, torch.bfloat16, 2) == whole // 2
    assert kv_bytes_per_token(config, torch.bfloat16, 8) == whole // 4  # one (replicated) head per rank
