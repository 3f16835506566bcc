"""`python -m colo.grpo` end to end on CPU: reward improves, the KV cache is released while training,
a SIGKILLed run resumes without losing or repeating a step, two ranks under torchrun train exactly
as one rank does, and a failing engine is rebuilt from the shared weights.

One uninterrupted reference run (module fixture) is the yardstick for the others: generation is
seeded per (step, prompt) and training is deterministic on CPU, so a resumed or 2-rank run must
reproduce its records and weights.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port

from helpers.forked import Started, run_python
from helpers.grpo_runs import ENV, REPO, failure_report, grpo_args, launch, records, run_grpo, run_grpo_ranks

pytestmark = pytest.mark.slow

STEPS = 12


def model_weights(checkpoint: Path) -> dict:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = model_weights(a), model_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=atol, rtol=0), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grpo-reference")
    # bf16 weights shared with a bf16 engine, fp32 masters and moments with the optimizer (what vLLM
    # serves here, so the default; explicit so the test means the same on every machine). Offload
    # forced on (the CPU default is off); the 2-rank run, with the default, must match it.
    done = run_grpo(out, "--steps", str(STEPS), "--save-every", "1", "--keep-checkpoints", "0",
                    "--trace", str(out / "trace.json"), "--offload-optimizer", "on", "--dtype", "bf16",
                    "--report-to", "tensorboard", "--run-name", "reference")
    (out / "stdout.txt").write_text(done.stdout)
    return out


def test_stdout_has_the_summary_not_vllm_logs(reference):
    stdout = (reference / "stdout.txt").read_text()
    assert f"steps 1-{STEPS} done" in stdout
    assert "INFO" not in stdout and "reset prefix cache" not in stdout, stdout[:2000]


@pytest.mark.cpu_kind  # bf16 rounding and kernels differ between CPU kinds
def test_short_run_improves_reward_with_the_engine_on_the_trained_weights(reference):
    log = records(reference)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    first = sum(r["reward_mean"] for r in log[:3]) / 3
    last = sum(r["reward_mean"] for r in log[-3:]) / 3
    # A random policy scores ~0.25 on the toy rule; a dozen steps reach ~0.5 here.
    assert last > first + 0.12, [round(r["reward_mean"], 3) for r in log]
    for r in log:
        # The engine's log-probabilities of its own samples match the trainer's: it serves the
        # weights being trained (each step's publish), without copying a byte. bf16 kernels of the
        # two differ by a few 1e-2 (fp32: 1e-6, test_bf16_tracks_fp32); a stale weight by far more.
        assert r["engine_logprob_max_abs_diff"] < 0.1
        assert r["publish_bytes_copied"] == 0 and r["dtype"] == "bf16"
        assert r["tokens_generated"] == 8 * 8 * 16
        for key in ("generate_s", "train_s", "publish_s", "step_s", "reward_std", "loss", "grad_norm"):
            assert key in r and r[key] >= 0 or key == "loss"


def test_kv_cache_is_released_while_training(reference):
    for r in records(reference):
        assert r["kv_cache_resident_bytes_during_train"] == 0
        assert r["kv_cache_resident_bytes_during_generate"] > 0
        assert r["weights_resident_bytes_during_train"] > 0 and r["grads_resident_bytes_during_train"] > 0
        assert r["grads_resident_bytes_during_generate"] == 0
        if r["step"] > 1:  # the optimizer has state from its first step on, offloaded while generating
            assert r["optimizer_resident_bytes_during_generate"] == 0
            assert r["optimizer_resident_bytes_during_train"] > 0


def test_bf16_checkpoints_hold_the_fp32_master_weights_and_moments(reference):
    state = torch.load(reference / f"step-{STEPS:06d}.pt", weights_only=True)
    weights = {name: t for name, t in state["model"].items() if name != "lm_head.weight"}  # tied to the embedding
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    masters = state["optimizer"]["master_weights"]
    assert masters.dtype == torch.float32 and masters.numel() == sum(t.numel() for t in weights.values())
    moments = state["optimizer"]["optimizer"]["state"]
    assert len(moments) == len(weights)
    assert all(m["exp_avg"].dtype == m["exp_avg_sq"].dtype == torch.float32 for m in moments.values())
    # The weights the engine served are the masters rounded to bf16 (in parameter order), stochastically (the
    # default --master-rounding): each the bf16 value at or below its master's magnitude, or the one above.
    bits = masters.view(torch.int32) & -65536
    below, above = bits.view(torch.float32), (bits + 65536).view(torch.float32)

    def rounded_from_masters(t) -> bool:
        served = t.flatten().float()
        return bool(((served == below[:t.numel()]) | (served == above[:t.numel()])).all())

    assert any(rounded_from_masters(t) for t in weights.values())


def saved_model(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def masters_by_name(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights after `step` by parameter name (assembled from shards when sharded)."""
    state = torch.load(out / f"step-{step:06d}.pt", map_location="cpu", weights_only=True)
    flat, masters, offset = optimizer_state(out, step)["master_weights"], {}, 0
    for name in state["param_names"]:
        shape = state["model"][name].shape
        masters[name] = flat[offset:offset + shape.numel()].view(shape)
        offset += shape.numel()
    assert offset == flat.numel()
    return masters


def test_the_run_leaves_its_model_in_hugging_face_format_from_the_fp32_masters(reference, tmp_path):
    """OUT/final: the toy's own dtype (fp32), so the fp32 masters exactly, not the bf16 copy the engine
    served; `python -m colo.grpo.export --save-dtype bf16` of the checkpoint is the masters rounded to
    nearest, within a bf16 step of that served copy (rounded stochastically)."""
    saved, masters = saved_model(reference / "final"), masters_by_name(reference, STEPS)
    assert saved.keys() == masters.keys()  # the tied head is the embedding, saved once
    assert all(saved[n].dtype == torch.float32 and torch.equal(saved[n], masters[n]) for n in saved)
    served = model_weights(reference / f"step-{STEPS:06d}.pt")
    assert any(not torch.equal(saved[n], served[n].float()) for n in saved)  # bf16 rounding dropped something
    bf16 = tmp_path / "bf16"
    done = run_python("colo.grpo.export", [str(reference), "-o", str(bf16), "--save-dtype", "bf16"], ENV, cwd=REPO,
                      timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    exported = saved_model(bf16)
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], masters[n].to(torch.bfloat16))
               for n in exported)
    assert all(bool(((exported[n].float() - served[n].float()).abs() <= masters[n].abs() * 2 ** -7).all())
               for n in exported)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_transformers_and_stock_vllm_load_the_saved_model_and_agree(reference, prompt_logprobs):
    from colo.bench.baselines import stock_llm
    from colo.engine import release_llm

    from conftest import PROMPTS, load_hf_model
    from helpers.logprobs import trainer_logprobs

    expected = trainer_logprobs(load_hf_model(reference / "final"), PROMPTS, torch.float64)
    llm = stock_llm(reference / "final", dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
                    enforce_eager=True)
    try:
        served = prompt_logprobs(llm)
    finally:
        release_llm(llm)
    # Both fp32: kernel differences only (vLLM's own tests allow far more).
    torch.testing.assert_close(served, expected, atol=2e-4, rtol=0)


def test_the_saved_model_trains_as_the_model_of_a_new_run_and_a_failed_save_loses_nothing(reference, tmp_path):
    out = tmp_path / "from-final"
    out.mkdir()
    (out / "final.writing").write_text("in the way")  # the final save cannot stage its directory
    done = launch(out, "--steps", "1", "--model", str(reference / "final"), "--eager", timeout=300)
    assert done.returncode != 0
    assert f"writing the model to {out / 'final'} failed" in done.stderr, done.stderr[-2000:]
    assert "python -m colo.grpo.export" in done.stderr
    assert [r["step"] for r in records(out)] == [1]
    assert (out / "step-000001.pt").is_file() and not (out / "final").exists()


def test_every_step_record_reaches_tensorboard(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference / "runs" / "reference"))
    events.Reload()
    log = records(reference)
    for key in ("reward_mean", "train_s", "publish_bytes_copied"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in log], key
    assert '"report_to": [' in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_timeline_has_every_phase_of_every_step(reference):
    events = json.loads((reference / "trace.json").read_text())  # a finished run closes the array
    for phase in ("generate", "train", "publish"):
        steps = sorted(e["args"]["step"] for e in events if e.get("ph") == "X" and e["name"] == phase)
        assert steps == list(range(1, STEPS + 1)), phase
    assert any(e.get("ph") == "C" and e["args"].get("kv_cache") == 0 for e in events)


def start_and_wait_for_step(out: Path, step: int, *extra: str) -> Started:
    """Start a run and return once its log holds a record of `step` (or later)."""
    proc = Started("colo.grpo", grpo_args(out, "--steps", str(STEPS), *extra), ENV, cwd=REPO)
    log, deadline = out / "log.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(json.loads(line)["step"] >= step for line in lines[:-1]) or len(lines) > step:
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"run ended or stalled before step {step}: {proc.communicate()[1][-2000:]}")


def test_sigterm_stops_cleanly_and_sigkill_loses_no_step(reference, tmp_path):
    out = tmp_path / "interrupted"
    # SIGTERM: the run finishes its step, checkpoints exactly there and exits 143.
    # Offload on, as in the reference run: resuming then restores optimizer state into a sleeping region.
    # bf16 as the reference (dtype auto picks fp32 on an AVX2 CPU, and the rewards would differ).
    proc = start_and_wait_for_step(out, 3, "--save-every", "5", "--offload-optimizer", "on", "--dtype", "bf16")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err
    stopped_at = max(r["step"] for r in records(out))
    assert latest_checkpoint_step(out) == stopped_at < STEPS

    # SIGKILL a resumed run between checkpoints: the steps since its last checkpoint are redone.
    proc = start_and_wait_for_step(out, stopped_at + 3, "--resume")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert max(r["step"] for r in records(out)) < STEPS

    run_grpo(out, "--steps", str(STEPS), "--resume")
    log = records(out)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))  # contiguous, no step twice
    # Seeded generation and deterministic CPU training: the interrupted run is the reference run.
    expected = {r["step"]: r["reward_mean"] for r in records(reference)}
    assert [r["reward_mean"] for r in log] == pytest.approx([expected[s] for s in range(1, STEPS + 1)], abs=1e-6)
    assert_same_weights(out / f"step-{STEPS:06d}.pt", reference / f"step-{STEPS:06d}.pt", atol=1e-5)


def latest_checkpoint_step(out: Path) -> int:
    from colo.grpo.checkpoint import list_checkpoints

    return list_checkpoints(out)[-1][0]


def test_two_nodes_on_localhost_split_what_they_do_not_divide_and_train_like_one_node(tmp_path):
    """torchrun --nnodes 2 (two node ranks, one process each, rendezvous on 127.0.0.1), as the README's
    multi-node command, with 7 prompts per step: the ranks take 4 and 3, and each trains a group as soon
    as it is done (--overlap on). Seeds follow the prompt's index in the step, rewards are over the whole
    batch and the loss is the token mean over it, so the steps are those of one rank with all 7 prompts.
    (Two ranks on one node, dividing the prompts evenly, against the reference run: the sharded test.)
    fp32 and eager engines: what is tested is the split and the launch, the same on every CPU kind; bf16
    over two ranks is the sharded test's."""
    one, two = tmp_path / "one", tmp_path / "two-nodes"
    common = ["--steps", "2", "--save-every", "1", "--keep-checkpoints", "0", "--prompts-per-step", "7",
              "--dtype", "fp32", "--eager"]
    run_grpo(one, *common)
    port = free_port()
    args = grpo_args(two, *common, "--overlap", "on", "--trace", str(two / "trace.json"))
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               "-m", "colo.grpo", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [failure_report(err) for _, err in outputs]
    a, b = records(one), records(two)
    assert [r["step"] for r in b] == [1, 2]
    assert b[0]["overlap"] and not a[0]["overlap"]
    # Each rank generated its share with its own engine; rewards are over the whole batch.
    assert a[0]["tokens_generated"] == b[0]["tokens_generated"] == 7 * 8 * 16
    assert b[0]["reward_mean"] == pytest.approx(a[0]["reward_mean"], abs=1e-9)  # the same completions
    # Averaged gradients (exact global token mean): the same update as one rank with all prompts (a sum
    # instead of a mean over ranks would be 2x off), rounding apart.
    assert_trains_like(two, one, last_step=2)
    assert [r["reward_mean"] for r in b] == pytest.approx([r["reward_mean"] for r in a], abs=0.02)
    assert (two / "trace.rank1.json").exists()


def optimizer_state(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The run's fp32 master weights and AdamW moments after `step`, each one flat tensor in
    parameter order, assembled from the optimizer shards when the run was sharded (an fp32 run's
    weights are its masters, and torch's AdamW state is the optimizer's)."""
    checkpoint = torch.load(out / f"step-{step:06d}.pt", weights_only=True)
    state = checkpoint["optimizer"]
    if "sharded_over" not in state:
        plain = "master_weights" not in state
        moments = (state if plain else state["optimizer"])["state"]
        flat = {key: torch.cat([moments[i][key].reshape(-1) for i in sorted(moments)]) for key in ("exp_avg", "exp_avg_sq")}
        masters = torch.cat([checkpoint["model"][name].reshape(-1) for name in checkpoint["param_names"]]) if plain \
            else state["master_weights"]
        return {"master_weights": masters, **flat}
    shards = [torch.load(p, weights_only=True)["optimizer"] for p in sorted(out.glob(f"step-{step:06d}.optimizer-*"))]
    full = {key: torch.full((sum(shards[0]["param_numels"]),), float("nan"))
            for key in ("master_weights", "exp_avg", "exp_avg_sq")}
    for shard in shards:
        offset = 0
        for begin, end in shard["ranges"].tolist():
            for key, values in (("master_weights", shard["master_weights"]), *shard["state"].items()):
                full[key][begin:end] = values[offset:offset + end - begin]
            offset += end - begin
    assert not any(t.isnan().any() for t in full.values())  # every element is in some shard
    return full


BETAS, ADAM_EPS, LR = (0.9, 0.99), 1e-8, 3e-3  # colo.grpo's AdamW (GRPOConfig.adam_betas, torch's eps, --lr)
# bf16 keeps 8 significant bits: each rounding is off by at most 2^-8 relative. Runs that split the
# batch differently (over ranks, or prompts padded to another length) round each sum of the bf16
# forward and backward once more or less, so their gradients differ by a few of those; 2.5 of them
# bounds what both CPU kinds show (0.4% AVX-512-BF16 and AVX2 persona, relative L2).
GRADIENT_GAP = 2.5 * 2.0 ** -8


def adamw_update(state: dict, step: int) -> torch.Tensor:
    """The step torch's AdamW took at `step` (weight decay 0), from the moments it stored after it:
    masters(step) = masters(step - 1) - lr * adamw_update."""
    m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()
    return (m / (1 - BETAS[0] ** step)) / (v.sqrt() / (1 - BETAS[1] ** step) ** 0.5 + ADAM_EPS)


def adamw_max_update(step: int) -> float:
    """The most AdamW (betas above) can move one weight at `step`, in units of lr, whatever the
    gradients: |m_hat| / sqrt(v_hat) <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_j<step (b1^2 / b2)^j)
    * sqrt(1 - b2^step) / (1 - b1^step), by Cauchy-Schwarz on m's sum. About 1.003 for the first steps."""
    b1, b2 = BETAS
    return ((1 - b1) / (1 - b2) ** 0.5 * sum((b1 * b1 / b2) ** j for j in range(step)) ** 0.5
            * (1 - b2 ** step) ** 0.5 / (1 - b1 ** step))


def assert_trains_like(a: Path, b: Path, last_step: int, diverged_at: int = 1) -> None:
    """Two runs with the same weights and optimizer state up to `diverged_at - 1`, whose gradients at
    `diverged_at` differ only by rounding (another split of the batch, so bf16 sums in another order):

    - at `diverged_at` the gradients agree within GRADIENT_GAP, and each run's masters moved by
      exactly AdamW's step on its own gradients (two fp32 roundings of weights below 4 in size);
    - after it, the runs drift (where rounding flipped the sign of a near-zero gradient, AdamW moves
      that weight by lr the other way), but never further apart than AdamW can move a weight.
    """
    t = diverged_at
    sa, sb = optimizer_state(a, t), optimizer_state(b, t)
    m_before = optimizer_state(a, t - 1)["exp_avg"] if t > 1 else torch.zeros_like(sa["exp_avg"])
    gradient = (sa["exp_avg"] - BETAS[0] * m_before) / (1 - BETAS[0])
    gap = (sa["exp_avg"] - sb["exp_avg"]).norm() / (1 - BETAS[0]) / gradient.norm()
    assert gap < GRADIENT_GAP, (t, float(gap))
    moved_apart = LR * (adamw_update(sb, t) - adamw_update(sa, t))
    torch.testing.assert_close((sa["master_weights"] - sb["master_weights"]).double(), moved_apart,
                               atol=2 * 4 * 2.0 ** -24, rtol=0)
    for step in range(t + 1, last_step + 1):
        bound = 2 * LR * sum(adamw_max_update(k) for k in range(t, step + 1))
        worst = float((optimizer_state(a, step)["master_weights"] - optimizer_state(b, step)["master_weights"]).abs().max())
        assert worst <= bound, (step, worst, bound)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """ZeRO-1 (--shard-optimizer) on 2 ranks, 3 steps, a checkpoint after each (the two tests below)."""
    two = tmp_path_factory.mktemp("sharded") / "two"
    run_grpo_ranks(two, 2, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "0", "--shard-optimizer",
                   "--dtype", "bf16")
    return two


@pytest.mark.cpu_kind  # bf16 rounding and kernels differ between CPU kinds
def test_sharded_optimizer_trains_like_one_rank(reference, sharded_run):
    """ZeRO-1 (--shard-optimizer) on 2 ranks: the reference's rewards and weights, half the optimizer
    bytes per rank, one shard file per rank."""
    two = sharded_run
    log, expected = records(two), records(reference)
    assert log[0]["tokens_generated"] == 8 * 8 * 16  # each rank half the prompts, with its own engine
    assert [r["reward_mean"] for r in log] == pytest.approx([r["reward_mean"] for r in expected[:3]], abs=0.02)
    assert log[0]["reward_mean"] == pytest.approx(expected[0]["reward_mean"], abs=1e-9)
    # fp32 masters and two moments, 12 bytes per parameter: each rank holds about half.
    full = expected[0]["optimizer_state_bytes"]
    assert full / 2 <= log[0]["optimizer_state_bytes"] < full / 2 * 1.05
    assert all(r["publish_bytes_copied"] == 0 for r in log)  # the all-gather landed in the engine's weights
    assert sorted(p.name for p in two.glob("step-000003*")) == [
        "step-000003.optimizer-rank0-of-2.pt", "step-000003.optimizer-rank1-of-2.pt", "step-000003.pt"]
    assert_trains_like(two, reference, last_step=3)
    # OUT/final holds the fp32 masters, gathered from both ranks' shards
    saved, masters = saved_model(two / "final"), masters_by_name(two, 3)
    assert saved.keys() == masters.keys() and all(torch.equal(saved[n], masters[n]) for n in saved)


# Not cpu_kind: what it checks is the checkpoint's round trip, which the CPU kind's numbers do not change
# (the AVX2-persona pass runs the training comparison above, not the resumes again).
def test_a_sharded_run_resumes_on_any_number_of_ranks(sharded_run, tmp_path):
    """Killed after step 2, the 2-rank ZeRO-1 run resumes exactly on 2 ranks, and on 1 rank (a plain
    process) the shards are gathered into one and step 3 still matches. (Re-sharding onto 3 ranks,
    ranges across the old shards' bounds: tests/optimizers/test_zero.py.)"""
    import shutil

    two, log = sharded_run, records(sharded_run)
    for ranks in (2, 1):
        again = tmp_path / f"resumed-on-{ranks}"
        shutil.copytree(two, again)
        for stale in again.glob("step-000003*"):  # as if killed during step 3
            stale.unlink()
        lines = (again / "log.jsonl").read_text().splitlines()[:2]
        (again / "log.jsonl").write_text("\n".join(lines) + "\n")
        if ranks == 1:
            run_grpo(again, "--steps", "3", "--resume")
        else:
            run_grpo_ranks(again, ranks, "--steps", "3", "--resume")
        assert [r["step"] for r in records(again)] == [1, 2, 3]
        if ranks == 2:  # the same ranks, the same reductions: exactly the uninterrupted run
            assert records(again)[2]["reward_mean"] == log[2]["reward_mean"]
            assert_same_weights(again / "step-000003.pt", two / "step-000003.pt", atol=0)
        else:
            assert records(again)[2]["reward_mean"] == pytest.approx(log[2]["reward_mean"], abs=0.02)
            assert_trains_like(again, two, last_step=3, diverged_at=3)  # re-sharded: sums in another order
            assert len(list(again.glob("step-000003.optimizer-rank*-of-1.pt"))) == 1


def test_sharded_checkpoint_missing_a_shard_is_refused_by_name(tmp_path):
    from colo.grpo.checkpoint import (CheckpointError, load_checkpoint, load_optimizer_shards, save_checkpoint,
                                      save_optimizer_shard)

    for rank in range(2):
        save_optimizer_shard(tmp_path, 4, rank, 2, {"rank": rank})
    state = {"model": {}, "optimizer": {"sharded_over": 2}, "rng": [{}, {}], "config": {}}
    path = save_checkpoint(tmp_path, 4, state, keep=1)
    assert [s["rank"] for s in load_optimizer_shards(path, load_checkpoint(path))] == [0, 1]
    save_optimizer_shard(tmp_path, 5, 0, 2, {"rank": 0})  # a run killed before step 5's checkpoint
    (tmp_path / "step-000004.optimizer-rank1-of-2.pt").unlink()
    with pytest.raises(CheckpointError, match="sharded over 2 ranks, but .*step-000004.optimizer-rank1-of-2.pt is missing"):
        load_optimizer_shards(path, load_checkpoint(path))
    save_checkpoint(tmp_path, 6, state, keep=1)  # keeps step 6 only: older shards and orphans go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006.pt"]


def test_rank_share_splits_as_evenly_as_possible():
    from colo.grpo import distributed as D

    world = D.World(rank=0, size=3, local_rank=0)
    assert [len(D.rank_share(7, world, rank=r)) for r in range(3)] == [3, 2, 2]
    assert [D.rank_share(7, world, rank=r).start for r in range(3)] == [0, 3, 5]


def test_failing_engine_is_rebuilt_from_the_shared_weights_then_fails_clearly(tmp_path, monkeypatch, caplog):
    import weakref

    from colo.grpo import EngineFailure, GRPOConfig, GRPOScheduler, ToyTask, build_toy_model
    from colo.grpo.checkpoint import latest_checkpoint
    from colo.grpo.rollout_engine import RolloutEngine

    model_dir = build_toy_model(tmp_path / "model")
    task = ToyTask(512)
    config = GRPOConfig(prompts_per_step=4, num_generations=4, ignore_eos=True, learning_rate=3e-3, save_every=0)
    run = GRPOScheduler(model_dir, task.rewards, task.prompts, config, out_dir=tmp_path / "out")
    try:
        run.train_step()
        broken_engine = weakref.ref(run.engine.llm)
        kv_bytes_one_engine = run.engine.kv_region.stats()["allocated_bytes"]
        real_generate, calls = RolloutEngine.generate, []

        def fails_once(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected engine fault")
            return real_generate(self, *args, **kwargs)

        monkeypatch.setattr(RolloutEngine, "generate", fails_once)
        record = run.train_step()
        assert len(calls) == 2 and record["engine_rebuild_s"] > 0
        assert any("injected engine fault; rebuilding it" in r.getMessage() for r in caplog.records
                   if r.name == "colo.grpo.rollout_engine")
        # The old engine's memory really came back: the region holds one KV cache, not two, and the
        # old engine holds no tensors. (Its Python shell may outlive this: vLLM logs its config as a
        # record argument and pytest's log capture keeps records, so object death is not asserted.)
        assert run.engine.kv_region.stats()["allocated_bytes"] == kv_bytes_one_engine
        broken = broken_engine()
        if broken is not None:
            from colo.engine import engine_model

            assert all(p.numel() == 0 for p in engine_model(broken).parameters())
            del broken
        # The new engine started from placeholder weights; serving the trained ones proves it shares them.
        assert record["engine_logprob_max_abs_diff"] < 0.1

        def always_fails(self, *args, **kwargs):
            raise RuntimeError("injected permanent fault")

        monkeypatch.setattr(RolloutEngine, "generate", always_fails)
        with pytest.raises(EngineFailure, match="failed twice.*injected permanent fault"):
            run.run(3, progress=False)
        assert run.step == 2
        # Nothing trained is lost: the two finished steps were checkpointed on the way out.
        assert latest_checkpoint(tmp_path / "out").name == "step-000002.pt"
    finally:
        run.close()


def test_bench_baseline_step_is_a_correct_grpo_step(tmp_path):
    """The grpo_step benchmark's "usual way" (own weight copy, per-parameter publish, no phasing)
    must train and serve the same weights, or its timings compare against a broken step."""
    from colo.bench.grpo_step import new_run
    from colo.grpo import build_toy_model

    model_dir = build_toy_model(tmp_path / "model")
    run = new_run(model_dir, max_new_tokens=16, colocated=False)
    try:
        run.train_step()
        second = run.train_step()  # generated by the engine after one per-parameter publish
    finally:
        run.close()
    weight_bytes = sum(p.numel() * p.element_size() for p in run.model.parameters())
    assert second["publish_bytes_copied"] == weight_bytes  # every parameter copied, tied head once
    assert second["engine_logprob_max_abs_diff"] < 0.1      # ... into the right engine rows
    assert second["kv_cache_resident_bytes_during_train"] > 0  # nothing sleeps


def test_kv_cache_time_shares_the_training_memory(tmp_path, monkeypatch):
    """With a pool too small for every region at once, the run still trains: the KV cache uses the
    gradients' and optimizer state's bytes while they sleep (generation), and they get them back
    while it sleeps (training). Checkpointing between steps brings the optimizer state back for a
    moment, putting the KV cache to sleep first when both do not fit."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model
    from colo.grpo import rollout_engine

    monkeypatch.setattr(rollout_engine, "_KV_HEADROOM", 0)  # exact budgets, so the arithmetic below holds
    model_dir = build_toy_model(tmp_path / "model")
    task = ToyTask(512)
    # 64 sequences: a KV cache larger than the gradients, so the optimizer state cannot wake beside it.
    config = GRPOConfig(prompts_per_step=8, num_generations=8, ignore_eos=True, learning_rate=3e-3,
                        save_every=0, offload_optimizer=True, overlap="on")
    probe = GRPOScheduler(model_dir, task.rewards, task.prompts, config)
    budgets = {name: region.budget for name, region in probe.pool.regions.items()}
    probe.close()
    assert set(budgets) == {"weights", "kv_cache", "grads", "optimizer"}
    training = budgets["grads"] + budgets["optimizer"]
    capacity = budgets["weights"] + max(budgets["kv_cache"], training)  # each phase fits, not all at once
    assert sum(budgets.values()) > capacity

    run = GRPOScheduler(model_dir, task.rewards, task.prompts, config, out_dir=tmp_path / "out",
                        pool_capacity=capacity)
    try:
        assert {name: region.budget for name, region in run.pool.regions.items()} == budgets
        # Overlap would need the gradients awake beside the KV cache: it does not fit, so steps are serial.
        assert "do not fit in the pool" in run.serial_reason
        records = [run.train_step() for _ in range(2)]
        assert not run.engine.kv_region.asleep  # between steps the run is ready to generate
        assert budgets["optimizer"] > run.pool.unbudgeted_bytes
        slept = []
        sleep = run.engine.sleep_kv_cache
        monkeypatch.setattr(run.engine, "sleep_kv_cache", lambda: (slept.append(True), sleep()))
        assert run.save().name == "step-000002.pt"
        assert slept == [True]  # the KV cache made room for the optimizer state
        assert run.memory.optimizer_region.asleep  # offloaded again after the checkpoint
        assert not run.engine.kv_region.asleep  # and the KV cache woke again
        records.append(run.train_step())
    finally:
        run.close()
    for r in records:
        assert r["kv_cache_resident_bytes_during_train"] == 0 and r["kv_cache_resident_bytes_during_generate"] > 0
        assert r["grads_resident_bytes_during_generate"] == 0 and r["grads_resident_bytes_during_train"] > 0
        assert r["engine_logprob_max_abs_diff"] < 0.1  # the engine serves the trained weights
    assert all(r["optimizer_resident_bytes_during_generate"] == 0 for r in records[1:])


TRACKED_STEPS = 20  # the toy's reward rises by about 0.3 in 12 steps at this batch and learning rate


@pytest.mark.cpu_kind  # bf16 rounding and kernels differ between CPU kinds
def test_bf16_tracks_fp32_and_its_engine_serves_exactly_the_trainers_weights(tmp_path, build_engine,
                                                                            prompt_logprobs):
    """20 toy-task steps in bf16 (weights shared with a bf16 engine, fp32 masters and moments) and in
    fp32, same seeds: the reward curves stay within 0.05 of each other at every step (seen here:
    0.02 over 30 steps). After the first and the last bf16 step the engine serves what a fresh bf16
    engine built from the trainer's saved weights serves."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model

    model_dir = build_toy_model(tmp_path / "model")
    task = ToyTask(512)
    curves = {}
    for dtype in ("fp32", "bf16"):
        config = GRPOConfig(prompts_per_step=8, num_generations=8, ignore_eos=True, learning_rate=3e-3,
                            save_every=0, dtype=dtype)
        run = GRPOScheduler(model_dir, task.rewards, task.prompts, config)
        try:
            log = []
            for step in range(1, TRACKED_STEPS + 1):
                log.append(run.train_step())
                if dtype == "bf16" and step in (1, TRACKED_STEPS):
                    assert {p.dtype for p in run.model.parameters()} == {torch.bfloat16}
                    run.model.save_pretrained(tmp_path / f"bf16-step{step}")
                    fresh = build_engine(tmp_path / f"bf16-step{step}", dtype="bfloat16", enforce_eager=False)
                    run.engine.wake_kv_cache()  # it sleeps from training until the next generation
                    torch.testing.assert_close(prompt_logprobs(run.engine.llm), prompt_logprobs(fresh),
                                               atol=1e-3, rtol=0)
        finally:
            run.close()
        assert all(r["dtype"] == dtype and r["publish_bytes_copied"] == 0 for r in log)
        curves[dtype] = [r["reward_mean"] for r in log]
        if dtype == "fp32":
            assert max(r["engine_logprob_max_abs_diff"] for r in log) < 1e-4
    assert curves["bf16"][-1] > curves["bf16"][0] + 0.3
    assert max(abs(a - b) for a, b in zip(curves["bf16"], curves["fp32"])) < 0.05, curves
