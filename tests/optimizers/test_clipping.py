"""One clipping rule for every optimizer path (colo.clipping): over max_norm scaled as torch scales,
and a non-finite norm refused with nothing touched, so the optimizer step can be skipped and the
weights the engine serves stay finite. The scheduler side: tests/grpo/test_grpo_skipped_steps.py."""
from __future__ import annotations

import math

import pytest
import torch

from colo.clipping import clip_


def test_the_rule_scales_as_torch_and_refuses_what_is_not_finite():
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7)]
    reference = [g.clone().requires_grad_() for g in grads]
    for r, g in zip(reference, grads):
        r.grad = g.clone()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(reference, 0.5))
    norm = math.sqrt(sum(float(g.norm()) ** 2 for g in grads))
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    assert clip_(grads, norm, 0.5)
    for g, r in zip(grads, reference):
        torch.testing.assert_close(g, r.grad)
    small = [torch.ones(3)]
    assert clip_(small, 3 ** 0.5, 10.0) and torch.equal(small[0], torch.ones(3))  # under max_norm: untouched
    for bad in (float("inf"), float("nan")):
        grads = [torch.tensor([1.0, float("inf")]), torch.ones(2)]
        assert not clip_(grads, bad, 1.0)
        assert grads[0][1] == float("inf") and not grads[0].isnan().any() and torch.equal(grads[1], torch.ones(2))


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_master_weight_optimizers_report_a_non_finite_norm_and_touch_nothing(poison):
    """colo.MasterWeightOptimizer and ZeRO-1's colo.ShardedMasterWeightOptimizer (one rank): the norm is
    not finite, the main gradients are not scaled (no inf turned into NaN), the masters stay."""
    from colo import MasterWeightOptimizer, ShardedMasterWeightOptimizer

    for build in (lambda ps: MasterWeightOptimizer(ps, torch.optim.AdamW, lr=1e-2),
                  lambda ps: ShardedMasterWeightOptimizer(ps, torch.optim.AdamW, lr=1e-2)):
        params = [torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16)) for _ in range(2)]
        opt = build(params)
        (params[0].float().sum() + params[1].float().square().sum()).backward()
        opt.main_grads[0].view(-1)[3] = poison
        before = [m.clone() for m in opt.masters]
        norm = opt.clip_grad_norm_(1.0)
        assert not math.isfinite(norm)
        assert opt.main_grads[1].isfinite().all() and opt.main_grads[1].abs().sum() > 0  # not scaled to 0 or NaN
        assert torch.equal(opt.main_grads[0].view(-1)[3:4], torch.tensor([poison])) or math.isnan(poison)
        assert all(torch.equal(a, b) for a, b in zip(before, opt.masters))


@pytest.mark.parametrize("clip_first", [True, False])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_a_step_on_gradients_that_are_not_finite_is_skipped_by_the_optimizer_itself(poison, clip_first):
    """A library loop as the docs show it (backward, clip_grad_norm_, step) or one that never clips: with an
    inf or NaN gradient, step() leaves the masters and the 16-bit weights (the engine's) as they were and
    counts the skip; after zero_grad the next finite step steps. Both master-weight optimizers."""
    from colo import MasterWeightOptimizer, ShardedMasterWeightOptimizer

    for build in (lambda ps: MasterWeightOptimizer(ps, torch.optim.AdamW, lr=1e-2),
                  lambda ps: ShardedMasterWeightOptimizer(ps, torch.optim.AdamW, lr=1e-2)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16)) for _ in range(2)]
        opt = build(params)
        weights = [p.detach().clone() for p in params]
        (params[0].float().sum() + params[1].float().square().sum()).backward()
        opt.main_grads[1].view(-1)[5] = poison
        if clip_first:
            opt.clip_grad_norm_(1.0)
        opt.step()
        assert opt.skipped_steps == 1 and all(torch.equal(p, w) for p, w in zip(params, weights))
        assert all(p.isfinite().all() for p in params)
        opt.zero_grad()
        (params[0].float().sum() + params[1].float().square().sum()).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        assert opt.skipped_steps == 1 and not torch.equal(params[0], weights[0])


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_optimizers_colo_did_not_build_skip_a_step_on_gradients_that_are_not_finite(poison):
    """colo.refuse_non_finite_steps on a plain torch AdamW (the fp32 path; colo.trl's TRL optimizer), and
    colo.optimizer_masters.FP32Masters (colo.trl's fp32 masters): the weights, the masters and the
    optimizer's state stay as they were, the skip is counted; the next finite step steps."""
    import colo
    from colo.optimizer_masters import FP32Masters

    def plain():
        params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return params, optimizer, colo.refuse_non_finite_steps(optimizer)

    def fp32_masters():
        values = [torch.randn(4, 4) for _ in range(2)]
        params = [torch.nn.Parameter(v.bfloat16()) for v in values]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return params, optimizer, FP32Masters(optimizer, dict(zip(params, values)))

    for build in (plain, fp32_masters):
        torch.manual_seed(0)
        params, optimizer, guard = build()
        (params[0].float().sum() + params[1].float().square().sum()).backward()
        optimizer.step()  # a finite step first: the state the skipped step must not move
        model_zero_grad(params)
        weights = [p.detach().clone() for p in params]
        inner = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        state = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
        (params[0].float().sum() + params[1].float().square().sum()).backward()
        params[1].grad.view(-1)[5] = poison
        optimizer.step()
        assert guard.skipped_steps == 1, build.__name__
        assert all(torch.equal(p, w) for p, w in zip(params, weights)), build.__name__
        assert all(torch.equal(p, w) for p, w in zip((p for g in optimizer.param_groups for p in g["params"]), inner))
        for saved, now in zip(state, optimizer.state.values()):
            assert all(torch.equal(saved[k], now[k]) for k in saved), build.__name__
        model_zero_grad(params)
        (params[0].float().sum() + params[1].float().square().sum()).backward()
        optimizer.step()
        assert guard.skipped_steps == 1 and not torch.equal(params[0], weights[0]), build.__name__


def model_zero_grad(params) -> None:
    """As a trainer zeroes its model's gradients (FP32Masters' optimizer holds the masters, not these)."""
    for p in params:
        p.grad = None


def test_the_schedulers_clip_hands_its_norm_to_the_step_which_then_reads_no_gradient_again(monkeypatch):
    """colo.grpo's global_clipped_norm takes the norm through the views (shards summed, replicas once) and
    gives it to the master-weight optimizer: its step trusts that norm instead of looking through every
    gradient for an inf or a NaN (a pass over 4 bytes a parameter each step)."""
    from types import SimpleNamespace

    from colo import MasterWeightOptimizer
    from colo.grpo.distributed import World
    from colo.grpo.update import global_clipped_norm

    params = [torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16)) for _ in range(2)]
    opt = MasterWeightOptimizer(params, torch.optim.AdamW, lr=1e-2)
    (params[0].float().sum() + params[1].float().square().sum()).backward()
    memory = SimpleNamespace(shard=None, flat_grads={}, params=params)
    views = SimpleNamespace(grad_norm=lambda ps, gs: math.sqrt(sum(float(g.square().sum()) for g in gs)))
    world = World(rank=0, size=1, local_rank=0)
    norm = global_clipped_norm(memory, opt, views, world, max_norm=None)
    assert norm > 0 and opt._grad_norm == norm
    monkeypatch.setattr(opt, "_gradients_finite", lambda: pytest.fail("step() looked through the gradients"))
    before = [p.detach().clone() for p in params]
    opt.step()
    assert opt.skipped_steps == 0 and not torch.equal(params[0], before[0])
