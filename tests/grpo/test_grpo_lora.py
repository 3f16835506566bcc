"""`python -m colo.grpo --lora-rank R`: the adapter trains in the engine's LoRA slot with the base
frozen and shared, checkpoints hold the adapter and its optimizer state, a resumed run continues
exactly, and the exported adapter (PEFT's format) is what the engine served."""
from __future__ import annotations

import torch
import pytest

from colo.lora import read_adapter

from helpers.grpo_runs import records, run_grpo

pytestmark = pytest.mark.slow

# Eager engines: the compiled engine's LoRA slot is the in-process test's below (GRPOScheduler's default).
LORA = ("--lora-rank", "8", "--lora-alpha", "16", "--dtype", "bf16", "--lr", "3e-2", "--save-every", "1",
        "--keep-checkpoints", "0", "--eager")
STEPS = 4


def checkpoint(out, step: int) -> dict:
    return torch.load(out / f"step-{step:06d}.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run of STEPS steps, a checkpoint after each, and its stdout (the two tests below)."""
    whole = tmp_path_factory.mktemp("lora") / "whole"
    return whole, run_grpo(whole, "--steps", str(STEPS), *LORA, "--merge-lora").stdout


@pytest.mark.cpu_kind  # bf16 rounding and kernels differ between CPU kinds
def test_lora_run_trains_the_adapter_in_the_engine_slot(lora_run):
    whole, stdout = lora_run
    assert "LoRA rank 8, alpha 16" in stdout
    log = records(whole)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))

    state = checkpoint(whole, STEPS)
    adapter = state["model"]
    assert adapter and all(name.endswith((".lora_A", ".lora_B")) for name in adapter)  # the adapter only
    numel = sum(t.numel() for t in adapter.values())
    for r in log:
        assert r["publish_bytes_copied"] == 0
        # fp32 masters (4) and AdamW moments (8) of the adapter, nothing of the base
        assert r["optimizer_state_bytes"] == 12 * numel
        assert r["grads_resident_bytes_during_generate"] == 0 and r["kv_cache_resident_bytes_during_train"] == 0
        assert r["engine_logprob_max_abs_diff"] < 0.05  # bf16 engine and trainer on the same adapter
    assert any(t.abs().max() > 0 for n, t in adapter.items() if n.endswith("lora_B")), "B never left zero"

    # PEFT's format: A as trained, B in PEFT's units (the slot holds alpha/rank x B).
    spec, tensors = read_adapter(whole / "adapter")
    assert (spec.rank, spec.alpha) == (8, 16.0)
    for name, t in adapter.items():
        module, _, which = name.rpartition(".")
        exported = tensors[f"base_model.model.{module}.{which}.weight"].float()
        expected = t.float() / (spec.scaling if which == "lora_B" else 1.0)
        torch.testing.assert_close(exported, expected, atol=0, rtol=2 ** -7)  # one bf16 rounding
    # OUT/final: the same adapter in PEFT's format (the toy's own dtype, fp32) and, with --merge-lora,
    # the base with it merged in.
    spec_final, final = read_adapter(whole / "final")
    assert spec_final == spec and final.keys() == tensors.keys()
    for key in final:
        assert final[key].dtype == torch.float32
        torch.testing.assert_close(final[key].float(), tensors[key].float(), atol=0, rtol=2 ** -7)
    assert (whole / "final" / "merged" / "model.safetensors").is_file()


# Not cpu_kind: what it checks is the checkpoint's round trip, which the CPU kind's numbers do not change
# (the AVX2-persona pass runs the training checks above, not the resume again).
def test_a_lora_run_killed_after_step_2_resumes_exactly(lora_run, tmp_path):
    """Killed after step 2 (its checkpoint is the last thing it wrote), resumed to step 4: the same run."""
    whole, resumed = lora_run[0], tmp_path / "resumed"
    log, state = records(whole), checkpoint(whole, STEPS)
    adapter = state["model"]
    run_grpo(resumed, "--steps", "2", *LORA)
    run_grpo(resumed, "--steps", str(STEPS), "--resume", "--eager")
    for a, b in zip(log, records(resumed)):
        assert (a["step"], a["reward_mean"], a["loss"]) == (b["step"], b["reward_mean"], b["loss"])
    again = checkpoint(resumed, STEPS)
    for name, t in adapter.items():
        assert torch.equal(again["model"][name], t), name
    torch.testing.assert_close(again["optimizer"]["master_weights"], state["optimizer"]["master_weights"],
                               atol=0, rtol=0)


def test_lora_with_a_kl_reference_uses_the_shared_base_and_survives_an_engine_rebuild(tmp_path, monkeypatch):
    """beta > 0: the reference is the frozen base (the adapter switched off), not a copy of the model.
    An engine that raises at step 2 is rebuilt from placeholder weights: the optimizer's own adapter
    parameters, with their trained values, are the new engine's slot (the engine's log-probabilities
    agree with the trainer's) and the base is its weights (views.detach / views.rebind)."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model
    from colo.grpo.rollout_engine import RolloutEngine

    model_dir = build_toy_model(tmp_path / "model")
    task = ToyTask(512)
    config = GRPOConfig(prompts_per_step=4, num_generations=4, ignore_eos=True, learning_rate=3e-2, save_every=0,
                        beta=0.1, lora_rank=4, dtype="fp32")
    run = GRPOScheduler(model_dir, task.rewards, task.prompts, config)
    real_generate, calls = RolloutEngine.generate, []

    def fails_at_step_2(self, *args, **kwargs):
        calls.append(run.step + 1)
        if calls == [1, 2]:
            raise RuntimeError("injected engine fault")
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(RolloutEngine, "generate", fails_at_step_2)
    try:
        assert run.reference.state_dict() is None  # no weights of its own: the shared base, adapter off
        records = [run.train_step()]
        adapter, trained = run.views, [p.detach().clone() for p in run.views.parameters()]
        old_engine = run.engine.llm
        records += [run.train_step() for _ in range(2)]
        assert run.engine.llm is not old_engine and records[1]["engine_rebuild_s"] > 0
        assert run.views is adapter and run.engine.views is adapter   # the same views, the same parameters
        owned = {id(p) for p in run.optimizer.params}   # colo.MasterWeightOptimizer's (the adapter's scales)
        assert all(id(p) in owned for p in adapter.parameters())
        assert not adapter.moved_parameters() and adapter.llm is run.engine.llm
        base_weight = run.model.get_input_embeddings().weight
        assert base_weight.data_ptr() == run.engine.shared.layout["model.embed_tokens.weight"].param.data_ptr()
        assert not any(torch.equal(a, b) for a, b in zip(trained, adapter.parameters()))  # it trained on
    finally:
        run.close()
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # B starts at zero: policy == base
    assert records[-1]["kl"] > 1e-6
    # The rebuilt engine samples with the trainer's adapter and base: its log-probabilities agree.
    assert records[1]["engine_logprob_max_abs_diff"] < 1e-3 and records[2]["engine_logprob_max_abs_diff"] < 1e-3


@pytest.mark.parametrize("kwargs, message", [
    (dict(lora_rank=-1), "lora_rank must be"), (dict(lora_rank=4, lora_alpha=0), "alpha must be a number > 0"),
    (dict(lora_rank=4, shard_optimizer=True), "shard_optimizer with lora_rank"),
    (dict(lora_rank=4, lora_targets=("model.q_proj",)), "targets must be module names"),
])
def test_bad_lora_settings_are_refused_before_any_engine_starts(kwargs, message):
    from colo.grpo import GRPOConfig

    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)
