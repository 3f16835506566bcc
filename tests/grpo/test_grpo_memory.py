"""colo.grpo's training memory in the pool (colo.grpo.train_memory) and the memory phases that switch
it with the engine's KV cache (colo.grpo.phases): gradients and optimizer state live in pool regions,
are released and offloaded for generation in the order the step needs (offloaded only where the pool
needs it, without waiting) and come back as they were (no engine, fast)."""
import copy

import pytest
import torch

import colo
from colo.grpo.phases import MemoryPhases
from colo.grpo.train_memory import TrainingMemory
from helpers.models import one_layer_qwen2


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
    model = one_layer_qwen2()
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
    phases.to_generate_begin()  # what a step does between the two (the publish) sees:
    assert (memory.grads.asleep, memory.optimizer_state_away, engine.kv_cache_asleep) == (True, True, True)
    phases.to_generate_end()
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
    model = one_layer_qwen2()
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
    phases.to_generate_begin()
    assert memory.optimizer_state_away  # the publish runs while the optimizer state's copy out is in flight
    phases.to_generate_end()
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
    model = one_layer_qwen2().to(torch.bfloat16)
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


def test_optimizer_state_is_offloaded_only_where_the_pool_needs_it_and_without_waiting():
    model = one_layer_qwen2()
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
    model = one_layer_qwen2()
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
