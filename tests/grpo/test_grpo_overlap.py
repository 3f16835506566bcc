"""Overlap (colo.grpo.overlap): groups trained while the engine decodes the others give the serial step."""
from __future__ import annotations

import contextlib
import math
import threading
import time

import pytest
import torch

from colo.grpo import GRPOConfig
from colo.grpo.overlap import GroupFailed, GroupTrainer, OverlappedStep, serial_reason
from colo.grpo.backward import merge_stats


def test_serial_reasons_name_what_prevents_overlap():
    on = dict(device_type="cpu", groups=4)
    assert serial_reason(GRPOConfig(overlap="on"), **on) is None
    assert serial_reason(GRPOConfig(overlap="off"), **on) == "overlap is off"
    assert "tensor parallelism" in serial_reason(GRPOConfig(overlap="on", tensor_parallel=2), **on)
    assert "whole batch" in serial_reason(GRPOConfig(overlap="on", scale_rewards="batch"), **on)
    assert "one prompt per rank" in serial_reason(GRPOConfig(overlap="on"), device_type="cpu", groups=1)
    with pytest.raises(ValueError, match="overlap must be one of auto, on, off"):
        GRPOConfig(overlap="yes")


@pytest.mark.cpu_kind  # the device kind is the CPU's (an AVX2 persona is another kind)
def test_auto_overlaps_where_measured_faster_and_only_when_completions_end_apart(monkeypatch):
    from colo.dtype_choice import fastest_dtype
    from colo.grpo import overlap

    kind = overlap.device_kind("cpu")
    dtype = fastest_dtype("cpu").name
    assert kind not in ("cpu-avx2", "cpu-avx512") or dtype == "fp32"  # AVX512_BF16 without AMX may time either
    kinds = ("cpu-amx", "cpu-avx512-bf16", "cpu-avx512", "cpu-avx2", "cpu", "cuda")  # what device_kind returns
    caps = torch.cpu.get_capabilities()
    if caps.get("avx512_f") and not (caps.get("avx512_bf16") or caps.get("amx_bf16")):
        assert kind == "cpu-avx512"  # an AVX-512 Xeon without bf16 units is its own kind, not an AVX2 CPU
    assert kind in kinds and all(k in kinds and d in ("fp32", "bf16") for k, d in overlap.MEASURED_FASTER)
    auto = dict(device_type="cpu", groups=4)
    monkeypatch.setitem(overlap.MEASURED_FASTER, (kind, dtype), (False, "a.json"))
    assert f"not measured faster than a serial one on this device kind in this dtype ({kind}, {dtype};" in \
        serial_reason(GRPOConfig(), **auto)
    assert serial_reason(GRPOConfig(overlap="on"), **auto) is None
    monkeypatch.setitem(overlap.MEASURED_FASTER, (kind, dtype), (True, "a.json"))
    assert serial_reason(GRPOConfig(), **auto) is None
    # Measured in one dtype only: the other one, forced, is not covered by that measurement.
    other = "bf16" if dtype == "fp32" else "fp32"
    assert f"({kind}, {other};" in serial_reason(GRPOConfig(dtype=other), **auto)
    # Every completion max_new_tokens long: nothing finishes early, so auto does not pay for the thread.
    assert "ignore_eos and no stop tokens" in serial_reason(GRPOConfig(ignore_eos=True), **auto)
    assert serial_reason(GRPOConfig(ignore_eos=True), **auto, stop_tokens=True) is None
    assert "(cuda, bf16;" in serial_reason(GRPOConfig(dtype="bf16"), device_type="cuda", groups=4)  # no GPU measured it


def test_each_measured_decision_is_its_results_files():
    """MEASURED_FASTER says "faster" exactly where its file's overlapped step beat the serial one on both
    workloads in that dtype (ratio = serial / overlapped > 1 for some split of the threads)."""
    import json
    from pathlib import Path

    from colo.grpo import overlap

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    for (kind, dtype), (faster, file) in overlap.MEASURED_FASTER.items():
        rows = [r for r in json.loads((results / file).read_text())["rows"]
                if r.get("section") == "overlap" and r.get("dtype") == dtype and r.get("ratio")]
        workloads = {"toy": [r for r in rows if "qwen2" in r["case"]], "real": [r for r in rows if "smollm2" in r["case"]]}
        assert all(workloads.values()), (file, dtype)
        assert faster == all(max(r["ratio"] for r in w) > 1 for w in workloads.values()), (kind, dtype, file)


def test_merged_stats_are_the_whole_batchs():
    groups = [dict(loss=0.5, tokens=10.0, clip_fraction=0.2, kl=0.1, engine_logprob_max_abs_diff=1e-3,
                   engine_logprob_abs_diff_sum=2e-3, engine_logprob_tokens=10.0),
              dict(loss=0.25, tokens=30.0, clip_fraction=0.0, kl=0.5, engine_logprob_max_abs_diff=4e-3,
                   engine_logprob_abs_diff_sum=6e-3, engine_logprob_tokens=30.0)]
    merged = merge_stats(groups)
    assert merged["loss"] == 0.75 and merged["tokens"] == 40.0
    assert merged["clip_fraction"] == pytest.approx(0.2 * 10 / 40)
    assert merged["kl"] == pytest.approx((0.1 * 10 + 0.5 * 30) / 40)
    assert merged["engine_logprob_max_abs_diff"] == 4e-3 and merged["engine_logprob_tokens"] == 40.0


def test_group_trainer_runs_groups_on_its_thread_and_hands_back_the_first_error():
    threads = []

    def work(index, payload):
        threads.append(threading.current_thread())
        if payload == "bad":
            raise ValueError(f"group {index} is bad")
        return payload * 2

    trainer = GroupTrainer(work, device=torch.device("cpu"), engine_threads=1, trainer_threads=1)
    before = torch.get_num_threads()
    trainer.submit(1, 10)
    trainer.submit(0, 20)
    outcome = trainer.join()
    assert outcome.results == {1: 20, 0: 40} and outcome.trained_during_generation <= 2
    # Trained during generation: on the trainer's thread; the rest on this one (join).
    assert sum(t is not threading.current_thread() for t in threads) == outcome.trained_during_generation
    assert torch.get_num_threads() == before  # the engine's thread got its cores back

    one_each = dict(device=torch.device("cpu"), engine_threads=1, trainer_threads=1)
    failing = OverlappedStep(lambda rows, prompts, c: (None, c), work, **one_each)
    on_group = failing.round([0, 1, 2], [[1], [2], [3]])
    on_group(0, "bad")
    failing.trainer._thread.join()
    with pytest.raises(GroupFailed, match="training group 1: ValueError: group 0 is bad"):
        on_group(1, 5)  # the engine's loop stops at the next group
    with pytest.raises(ValueError, match="group 0 is bad"):
        failing.join()

    scoring_fails = OverlappedStep(lambda rows, prompts, c: 1 / 0, work, **one_each)
    with pytest.raises(GroupFailed) as raised:
        scoring_fails.round([0], [[1]])(0, [])
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    scoring_fails.abandon()


def test_the_threads_split_while_both_have_work_and_the_groups_left_train_on_the_steps_thread():
    """GRPOConfig.overlap_threads (E, T): the engine's thread on E threads once the trainer has work, the
    trainer's on T while generation runs (oversubscribed here: E + T > cores); the group in hand when
    generation ends takes the step's threads from its next backward (catch_up), and the groups still
    waiting train in join(), on the step's thread with its own threads."""
    seen, group_started, generation_over = [], threading.Event(), threading.Event()

    def work(index, payload):
        seen.append((index, torch.get_num_threads(), threading.current_thread() is threading.main_thread()))
        if index == 0:
            group_started.set()
            assert generation_over.wait(60)
            trainer.catch_up()  # between its forward and its backward
            seen.append((index, torch.get_num_threads(), "after catch_up"))
        return payload

    before = torch.get_num_threads()
    trainer = GroupTrainer(work, device=torch.device("cpu"), engine_threads=before + 1, trainer_threads=before + 3)
    trainer.submit(0, "a")
    assert torch.get_num_threads() == before + 1  # the engine's thread, while the trainer has work
    assert group_started.wait(60)
    trainer.catch_up()  # not the trainer's thread: changes nothing
    assert torch.get_num_threads() == before + 1
    trainer.generation_done()
    assert torch.get_num_threads() == before  # the engine is done: its thread gets its count back
    trainer.submit(1, "b")  # a group left for after generation
    generation_over.set()
    outcome = trainer.join()
    assert seen == [(0, before + 3, False), (0, before, "after catch_up"), (1, before, True)]
    assert outcome.results == {0: "a", 1: "b"} and outcome.trained_during_generation == 1
    assert torch.get_num_threads() == before


def test_on_a_gpu_the_trainer_runs_on_the_train_stream_ordered_after_and_before_the_steps_work(monkeypatch):
    """The GPU hand-over, with torch.cuda's stream functions replaced by recording fakes (no GPU here):
    the train stream waits for the step's stream (the gradients were woken and zeroed there) before any
    group, each group's kernels are issued with the train stream current on the trainer's thread, and
    join() makes the step's stream wait for the train stream before the all-reduce and optimizer step."""
    events, current = [], threading.local()

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    step_stream, train_stream = FakeStream("step"), FakeStream("train")

    @contextlib.contextmanager
    def stream(s):
        before, current.stream = getattr(current, "stream", step_stream), s
        try:
            yield
        finally:
            current.stream = before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(current, "stream", step_stream))
    monkeypatch.setattr(torch.cuda, "stream", stream)

    def work(index, payload):
        events.append(("work", index, torch.cuda.current_stream().name, threading.current_thread() is not main))
        return payload

    main, threads = threading.current_thread(), torch.get_num_threads()
    trainer = GroupTrainer(work, device=torch.device("cuda"), engine_threads=1, trainer_threads=1,
                           stream=train_stream)
    trainer.submit(0, "a")
    trainer.submit(1, "b")
    assert torch.get_num_threads() == threads  # a GPU's engine keeps its CPU threads
    for _ in range(6000):  # both trained during generation, on the trainer's thread
        if len(trainer.outcome.results) == 2:
            break
        time.sleep(0.01)
    trainer.generation_done()
    trainer.submit(2, "c")  # left for join(): the step's thread, after the train stream's work
    assert trainer.join().results == {0: "a", 1: "b", 2: "c"}
    assert events == [("wait", "train", "step"), ("work", 0, "train", True), ("work", 1, "train", True),
                      ("wait", "step", "train"), ("work", 2, "step", False)]

    # abandon() (generation or the train phase failed): the groups not started are dropped, and the
    # step's stream still waits for what the train stream queued before anything else runs.
    events.clear()
    trainer = GroupTrainer(work, device=torch.device("cuda"), engine_threads=1, trainer_threads=1,
                           stream=train_stream)
    trainer.submit(0, "a")
    for _ in range(6000):
        if trainer.outcome.results:
            break
        time.sleep(0.01)
    trainer.submit(1, "b")
    trainer.abandon()
    assert events[:2] == [("wait", "train", "step"), ("work", 0, "train", True)]
    assert events[-1] == ("wait", "step", "train") and ("work", 1, "step", False) not in events


@pytest.mark.slow
def test_an_overlapped_step_is_the_serial_step(tmp_path):
    """One step on the long-tail toy task (completions end at stop tokens, so groups finish at different
    times), serial and overlapped, from the same weights and seeds: the same completions, rewards
    and loss; gradients equal up to float summation order, and the weights after the optimizer step
    within what that difference can move them."""
    from colo.grpo import GRPOScheduler, build_toy_model
    from colo.grpo.task import RewardError
    from colo.grpo.toy_task import long_tail_toy_task

    model_dir = build_toy_model(tmp_path / "model")
    lr = 3e-3
    runs = {}
    for name, overlap, micro in (("serial", "off", None), ("serial, groups as micro-batches", "off", 4),
                                 ("overlapped", "on", None)):
        # memory_phases=False keeps the step's gradients awake after it, to compare; unclipped, so
        # that a wrong scale shows.
        config = GRPOConfig(prompts_per_step=6, num_generations=4, max_new_tokens=64, learning_rate=lr,
                            max_grad_norm=None, save_every=0, memory_phases=False, overlap=overlap, micro_batch_size=micro,
                            dtype="fp32")
        run = GRPOScheduler(model_dir, config=config, task=long_tail_toy_task(mean_length=16),
                            engine_options=dict(enforce_eager=True))
        try:
            assert (run.serial_reason is None) == (overlap == "on")
            completions = []
            original = run.engine.generate

            def keep(*args, **kwargs):
                out = original(*args, **kwargs)
                completions.extend(c.token_ids for c in out)
                return out

            run.engine.generate = keep
            record = run.train_step()
            runs[name] = dict(record=record, completions=list(completions),
                              grads={n: p.grad.detach().clone() for n, p in run.model.named_parameters()},
                              after={n: p.detach().clone() for n, p in run.model.named_parameters()})
            if overlap == "on":  # a reward function raising mid-generation: its error, no engine rebuild
                rewards = run.task.reward_fn
                run.task.reward_fn = lambda prompts, completions: 1 / 0
                engine = run.engine.llm
                with pytest.raises(RewardError, match="ZeroDivisionError.*at step 2"):
                    run.train_step()
                assert run.engine.llm is engine and run.step == 1
                run.task.reward_fn = rewards  # and the next step runs as usual
                assert run.train_step()["step"] == 2
        finally:
            run.close()
    serial, reordered, overlapped = runs["serial"], runs["serial, groups as micro-batches"], runs["overlapped"]
    lengths = [len(c) for c in serial["completions"]]
    assert min(lengths) < max(lengths)  # groups finish at different times
    assert overlapped["completions"] == serial["completions"]
    assert overlapped["record"]["overlap"] and overlapped["record"]["groups_trained_during_generation"] >= 1
    assert overlapped["record"]["overlap_train_s"] > 0 and "generate_tail_s" in overlapped["record"]
    for key in ("reward_mean", "reward_std", "tokens_generated", "clipped_ratio"):
        assert overlapped["record"][key] == serial["record"][key], key
    # Summation order: the same serial step with each group as its own micro-batch differs from the
    # whole-batch one only in the order float additions happen; the overlapped step (each group
    # packed on its own, dapo's token mean applied after the sum) may differ by that much again
    # (x4 for the packing and the later division), plus a few ulps of the largest gradient.
    eps = torch.finfo(torch.float32).eps
    for n, g in serial["grads"].items():
        order_noise = (reordered["grads"][n] - g).abs().max()
        bound = 4 * order_noise + 8 * eps * g.abs().max()
        assert (overlapped["grads"][n] - g).abs().max() <= bound, n
    assert overlapped["record"]["loss"] == pytest.approx(serial["record"]["loss"], rel=1e-5, abs=1e-7)
    assert overlapped["record"]["grad_norm"] == pytest.approx(serial["record"]["grad_norm"], rel=1e-5)
    # One AdamW step from fresh moments moves a weight by lr * g / (|g| + adam_eps): that function
    # changes by at most |dg| / (min(|g|, |g'|) + adam_eps) per unit lr (|dg| / adam_eps across a sign
    # change), plus the rounding of the weight itself.
    adam_eps = 1e-8
    for n, w in serial["after"].items():
        g, g2 = serial["grads"][n], overlapped["grads"][n]
        same_sign = torch.where(g * g2 > 0, torch.minimum(g.abs(), g2.abs()), torch.zeros_like(g))
        bound = lr * (g - g2).abs() / (same_sign + adam_eps) + 4 * eps * w.abs().clamp(min=lr)
        assert ((overlapped["after"][n] - w).abs() <= bound).all(), n


@pytest.mark.slow
def test_an_overlapped_steps_train_figures_are_taken_with_the_kv_cache_asleep(tmp_path):
    """Groups trained while the engine still generates sample memory as generation (the KV cache is
    awake then); the train phase's figures are those with it asleep: 0 bytes of KV cache."""
    from colo.grpo import GRPOScheduler, build_toy_model
    from colo.grpo.toy_task import long_tail_toy_task

    config = GRPOConfig(prompts_per_step=6, num_generations=4, max_new_tokens=64, learning_rate=3e-3, save_every=0,
                        overlap="on", dtype="fp32")
    run = GRPOScheduler(build_toy_model(tmp_path / "model"), config=config, task=long_tail_toy_task(mean_length=16),
                        engine_options=dict(enforce_eager=True))
    try:
        assert run.serial_reason is None
        record = run.train_step()
    finally:
        run.close()
    assert record["overlap"] and record["groups_trained_during_generation"] >= 1
    assert record["kv_cache_resident_bytes_during_train"] == 0
    assert record["kv_cache_resident_bytes_during_generate"] > 0 and record["grads_resident_bytes_during_generate"] > 0


@pytest.mark.slow
def test_out_of_memory_while_training_during_generation_redoes_the_step_serially(tmp_path):
    """A group's backward running out of memory beside the engine: the groups trained so far are
    dropped, the gradients sleep again, and the step is generated and trained again serially (the
    record says why); the next step overlaps again."""
    from colo.grpo import GRPOScheduler, build_toy_model
    from colo.grpo.toy_task import long_tail_toy_task

    config = GRPOConfig(prompts_per_step=6, num_generations=4, max_new_tokens=64, learning_rate=3e-3, save_every=0,
                        overlap="on", dtype="fp32")
    run = GRPOScheduler(build_toy_model(tmp_path / "model"), config=config, task=long_tail_toy_task(mean_length=16),
                        engine_options=dict(enforce_eager=True))
    backward, failures = run.trainer.backward, []

    def out_of_memory_once(*args, **kwargs):
        if run.strategy.generating and not failures:
            failures.append(run.step + 1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test)")
        return backward(*args, **kwargs)

    run.trainer.backward = out_of_memory_once  # what the strategy trains through
    try:
        first = run.train_step()
        assert failures == [1] and first["step"] == 1
        assert first["overlap"] is False and "out of memory while training during generation" in first["overlap_fallback"]
        assert "redone serially" in first["overlap_fallback"] and first.get("groups_trained_during_generation", 0) == 0
        assert math.isfinite(first["loss"]) and first["tokens_generated"] > 0
        assert run.memory.grads.asleep  # between steps, as after any step
        second = run.train_step()
        assert second["overlap"] is True and "overlap_fallback" not in second
    finally:
        run.close()


def test_round_picks_pick_the_first_kept_groups_in_prompt_order_whatever_order_they_finish_in():
    """A round's groups finishing in any order hand on, each as soon as it is sure, exactly the first
    `quota` kept groups in prompt order (what a serial step picks), and none twice."""
    import random

    from colo.grpo.overlap import RoundPicks

    rng = random.Random(0)
    for _ in range(200):
        size, first = rng.randint(1, 8), rng.randint(0, 5)
        kept = {first + i: rng.random() < 0.5 for i in range(size)}
        quota = rng.randint(0, size)
        picks, handed = RoundPicks(first, size, quota), []
        order = list(kept)
        rng.shuffle(order)
        for done, index in enumerate(order, 1):
            now = picks.finished(index, kept[index])
            # Only finished groups, and only once every group before them is finished or dropped.
            assert all(i in order[:done] for i in now)
            handed += now
        assert len(set(handed)) == len(handed)
        assert sorted(handed) == [i for i in sorted(kept) if kept[i]][:quota] == picks.picked


def test_unit_denominators_scaled_by_the_batch_count_are_every_loss_types_own():
    """An overlapped step sums each group's loss with denominators of one token or one sequence per
    rank and divides by the batch's count at the end (colo.grpo.loss.batch_total): for every loss type
    that equals the denominators the serial step uses."""
    from colo.grpo.loss import LOSS_TYPES, batch_total, loss_denominators

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    tokens, sequences, ranks = 17.0, 6.0, 2
    for loss_type in LOSS_TYPES:
        real = loss_denominators(loss_type, mask, global_tokens=tokens, global_sequences=sequences,
                                 max_new_tokens=3, ranks=ranks)
        unit = loss_denominators(loss_type, mask, global_tokens=float(ranks), global_sequences=float(ranks),
                                 max_new_tokens=3, ranks=ranks)
        scale = ranks / batch_total(loss_type, tokens, sequences)
        torch.testing.assert_close(1 / real, scale / unit, msg=loss_type)


@pytest.mark.slow
def test_dynamic_sampling_overlapped_trains_the_groups_the_serial_step_trains(tmp_path):
    """Dynamic sampling with overlap: the informative groups train as they finish and the replacement
    prompts generate while they do; the step picks the groups a serial step picks (the first
    informative ones in prompt order), with the same counts, loss and gradients up to float summation
    order. One engine: the serial and the overlapped strategy take turns at step 1 (learning rate 0,
    so the weights stay those both sample with)."""
    from colo.grpo import GRPOScheduler, build_toy_model
    from colo.grpo.strategy import SerialSteps
    from colo.grpo.toy_task import long_tail_toy_task

    task = long_tail_toy_task(mean_length=16)
    rewards = task.reward_fn
    # A prompt whose first token is odd scores 0 whatever is sampled: its group teaches nothing.
    task.reward_fn = lambda prompts, completions: [r * (p[0] % 2 == 0) for p, r in
                                                    zip(prompts, rewards(prompts, completions))]
    config = GRPOConfig(prompts_per_step=6, num_generations=4, max_new_tokens=48,
                        max_grad_norm=None, save_every=0, memory_phases=False, overlap="on", dtype="fp32",
                        loss_type="grpo", dynamic_sampling=3)
    run = GRPOScheduler(build_toy_model(tmp_path / "model"), config=config, task=task,
                        engine_options=dict(enforce_eager=True))
    overlapped_steps = run.strategy
    trained = {}   # overlapped or not -> the (prompt, completion) pairs backward took
    backward = run.trainer.backward

    def watched(rollout, *args, **kwargs):
        pairs = [(tuple(p), tuple(c)) for p, c in zip(rollout.prompts, rollout.completions)]
        trained.setdefault(run.strategy is overlapped_steps, []).extend(pairs)
        return backward(rollout, *args, **kwargs)

    run.trainer.backward = watched
    run.lr_scheduler.base_lrs = [0.0 for _ in run.lr_scheduler.base_lrs]  # every step's lr: 0 x the schedule's
    for group in run.lr_scheduler.optimizer.param_groups:
        group["lr"] = 0.0
    runs = {}
    try:
        assert run.serial_reason is None
        serial_steps = SerialSteps(run.engine, run.task, config, run.world, run.trainer, memory=run.memory)
        for name, strategy, micro in (("serial", serial_steps, None),
                                      ("serial, groups as micro-batches", None, 4),
                                      ("overlapped", overlapped_steps, None)):
            run.strategy = strategy or run.strategy
            config.micro_batch_size = micro
            run.step = 0
            record = run.train_step()
            runs[name] = dict(record=record, grads={n: p.grad.detach().clone() for n, p in run.model.named_parameters()})
    finally:
        run.close()
    serial, reordered, overlapped = runs["serial"], runs["serial, groups as micro-batches"], runs["overlapped"]
    assert serial["record"]["dynamic_sampling/extra_generations"] >= 1   # groups were replaced
    assert 0 < serial["record"]["dynamic_sampling/trained_groups"]
    for key in ("generated_groups", "dropped_groups", "trained_groups", "extra_generations"):
        assert overlapped["record"][f"dynamic_sampling/{key}"] == serial["record"][f"dynamic_sampling/{key}"], key
    assert overlapped["record"]["overlap"] and overlapped["record"]["groups_trained_during_generation"] >= 1
    # The same completions trained (the serial strategy's two passes each trained them).
    assert len(trained[True]) == 4 * serial["record"]["dynamic_sampling/trained_groups"]
    assert sorted(trained[True]) == sorted(trained[False][:len(trained[True])]) == sorted(trained[False][len(trained[True]):])
    assert overlapped["record"]["reward_mean"] == serial["record"]["reward_mean"]
    eps = torch.finfo(torch.float32).eps
    for n, g in serial["grads"].items():   # as in test_an_overlapped_step_is_the_serial_step
        order_noise = (reordered["grads"][n] - g).abs().max()
        assert (overlapped["grads"][n] - g).abs().max() <= 4 * order_noise + 8 * eps * g.abs().max(), n
    assert overlapped["record"]["loss"] == pytest.approx(serial["record"]["loss"], rel=1e-5, abs=1e-7)
    assert overlapped["record"]["grad_norm"] == pytest.approx(serial["record"]["grad_norm"], rel=1e-5)
