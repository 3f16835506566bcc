"""A GRPO step whose gradient norm is inf or NaN skips its update: the weights the engine serves stay
those of the last good step, the record says so, and max_skipped_steps such steps in a row stop the
run with NonFiniteGradients, the last checkpoint intact. On the fp32 path (AdamW on the shared
weights) and the bf16 one (colo.MasterWeightOptimizer's fp32 masters)."""
from __future__ import annotations

import math

import pytest
import torch

from colo.errors import NonFiniteGradients

pytestmark = pytest.mark.slow


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype, poison", [("fp32", float("inf")), ("bf16", float("nan"))])
def test_non_finite_gradients_skip_the_update_and_stop_the_run_after_a_few(tmp_path, dtype, poison):
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model
    from colo.grpo.checkpoint import list_checkpoints

    model_dir = build_toy_model(tmp_path / "model")
    task = ToyTask(512)
    config = GRPOConfig(prompts_per_step=2, num_generations=4, max_new_tokens=8, ignore_eos=True, dtype=dtype,
                        learning_rate=3e-3, save_every=1, max_skipped_steps=2)
    run = GRPOScheduler(model_dir, task.rewards, task.prompts, config, out_dir=tmp_path / "out",
                        engine_options={"enforce_eager": True})
    try:
        first = run.run(1, progress=False)[0]
        assert first["step_skipped"] is False and math.isfinite(first["grad_norm"])
        good = weights(run.model)
        target = run.model.model.layers[0].mlp.down_proj.weight

        def poisoned(grad):
            grad = grad.clone()
            grad.view(-1)[0] = poison
            return grad

        hook = target.register_hook(poisoned)
        second = run.run(2, progress=False)[0]
        assert second["step_skipped"] is True and second["skipped_steps_in_a_row"] == 1
        assert not math.isfinite(second["grad_norm"])
        now = weights(run.model)
        assert all(torch.equal(now[n], good[n]) for n in good)  # the engine serves these: untouched
        with pytest.raises(NonFiniteGradients, match="step 3: the gradient norm was .* for 2 step.s. in a row"):
            run.run(3, progress=False)
        assert [s for s, _ in list_checkpoints(tmp_path / "out")][-1] == 2  # step 3 left no checkpoint
        assert all(torch.equal(p, good[n]) for n, p in weights(run.model).items())
        hook.remove()
        fourth = run.train_step()
        assert fourth["step_skipped"] is False and fourth["skipped_steps_in_a_row"] == 0
        after = weights(run.model)
        assert all(t.isfinite().all() for t in after.values())
        assert any(not torch.equal(after[n], good[n]) for n in good)
    finally:
        run.close()
