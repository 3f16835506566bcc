"""colo.MasterWeightOptimizer: 16-bit parameters trained through fp32 master weights."""
from __future__ import annotations

import copy

import pytest
import torch

import colo
from colo import MasterWeightOptimizer

pytestmark = pytest.mark.cpu_kind  # bf16 rounding differs between CPU kinds


def tiny_model(dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).to(dtype)


def test_a_master_weight_step_is_an_fp32_adamw_step_on_the_same_gradients():
    """Same starting values, same fp32 gradients: the masters take exactly the fp32 optimizer's step,
    and the bf16 parameters are those masters rounded."""
    bf16 = tiny_model(torch.bfloat16)
    fp32 = copy.deepcopy(bf16).float()  # exactly the bf16 values, in fp32
    opt = MasterWeightOptimizer(bf16.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(fp32.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, main, q in zip(bf16.parameters(), opt.main_grads, fp32.parameters()):
            g = torch.randn(p.shape, generator=generator)
            main.copy_(g)
            q.grad = g.clone()
        opt.step()
        reference.step()
    for p, master, q in zip(bf16.parameters(), opt.masters, fp32.parameters()):
        assert torch.equal(master, q.detach())                 # bit for bit the fp32 step
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16))  # rounded into the bf16 weights


def test_gradients_accumulate_in_fp32_across_backward_passes():
    model = tiny_model(torch.bfloat16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    single = []
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        single.append(opt.grad_flat.clone())
    torch.testing.assert_close(single[0], single[1], atol=0, rtol=0)
    model(input_ids=ids, labels=ids).loss.backward()  # a second micro-batch adds in fp32
    torch.testing.assert_close(opt.grad_flat, 2 * single[0], atol=0, rtol=0)
    assert all(p.grad is None for p in model.parameters())
    norm = opt.clip_grad_norm_(1e-3)
    assert norm > 1e-3 and float(torch.linalg.vector_norm(opt.grad_flat)) == pytest.approx(1e-3, rel=1e-3)


def test_parameters_keep_their_addresses_and_state_round_trips():
    model = tiny_model(torch.bfloat16)
    addresses = [p.data_ptr() for p in model.parameters()]
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    ids = torch.randint(0, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert [p.data_ptr() for p in model.parameters()] == addresses
    saved = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after_two = [p.detach().clone() for p in model.parameters()]

    opt.load_state_dict(saved)  # back to after one step, masters included
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for p, expected in zip(model.parameters(), after_two):
        assert torch.equal(p.detach(), expected)
    with pytest.raises(ValueError, match="master_weights"):
        opt.load_state_dict({"optimizer": saved["optimizer"]})


def test_masters_and_main_grads_go_into_the_regions_given():
    model = tiny_model(torch.bfloat16)
    pool = colo.Pool("cpu", capacity=1 << 30)
    numel = sum(p.numel() for p in model.parameters())
    masters, grads = pool.region("optimizer", budget=8 * numel), pool.region("grads", budget=8 * numel)
    opt = MasterWeightOptimizer(model.parameters(), master_region=masters, grad_region=grads, lr=1e-3)
    assert masters.contains(opt.master_flat) and grads.contains(opt.grad_flat)
    assert masters.stats()["allocated_bytes"] >= 4 * numel


@pytest.mark.parametrize("bad, error, message", [
    (lambda m: list(m.float().parameters()), TypeError, "bfloat16/float16"),
    (lambda m: [], ValueError, "no parameters"),
    (lambda m: [next(m.parameters())] * 2, ValueError, "twice"),
    (lambda m: [next(m.parameters()).requires_grad_(False)], ValueError, "does not require grad"),
])
def test_bad_parameters_are_refused(bad, error, message):
    with pytest.raises(error, match=message):
        MasterWeightOptimizer(bad(tiny_model(torch.bfloat16)), torch.optim.AdamW)


def test_fp32_masters_for_an_optimizer_built_elsewhere_step_save_and_restore():
    from colo.optimizer_masters import MASTERS_KEY, FP32Masters

    torch.manual_seed(0)
    values = [torch.randn(16, 8), torch.randn(8)]
    params = [torch.nn.Parameter(v.bfloat16()) for v in values]
    optimizer = torch.optim.AdamW(params, lr=1e-4)  # built over the bf16 parameters, as a trainer does
    addresses = [p.data_ptr() for p in params]
    masters = FP32Masters(optimizer, {p: v.clone() for p, v in zip(params, values)})
    assert [p.dtype for p in optimizer.param_groups[0]["params"]] == [torch.float32] * 2
    for _ in range(3):
        (params[0].float().sum() + 2 * params[1].float().sum()).backward()
        optimizer.step()
        for p in params:
            p.grad = None
    # The fp32 step is exact AdamW on fp32 values; the parameters are its rounding, in place. An
    # update of ~1e-4 is below bf16's spacing at these weights: only the masters hold it.
    reference = [torch.nn.Parameter(v.clone()) for v in values]
    plain = torch.optim.AdamW(reference, lr=1e-4)
    for _ in range(3):
        (reference[0].sum() + 2 * reference[1].sum()).backward()
        plain.step()
        plain.zero_grad()
    assert all(torch.equal(m, r) for m, r in zip(masters.masters, reference))
    assert all(torch.equal(p.detach(), m.bfloat16()) for p, m in zip(params, masters.masters))
    assert [p.data_ptr() for p in params] == addresses
    assert any(((m != v) & (m.bfloat16() == v.bfloat16())).any() for m, v in zip(masters.masters, values))

    state = optimizer.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(state[MASTERS_KEY], masters.masters))
    fresh = [torch.nn.Parameter(v.bfloat16()) for v in values]
    restored_optimizer = torch.optim.AdamW(fresh, lr=1e-4)
    restored = FP32Masters(restored_optimizer, {p: v.clone() for p, v in zip(fresh, values)})
    restored_optimizer.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(restored.masters, masters.masters))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(fresh, params))
    # A state saved without masters (e.g. before colo): the masters restart from the parameters.
    del state[MASTERS_KEY]
    restored_optimizer.load_state_dict(state)
    assert all(torch.equal(m, p.detach().float()) for m, p in zip(restored.masters, fresh))

    with pytest.raises(ValueError, match="has not stepped yet"):
        FP32Masters(optimizer, {})
    with pytest.raises(ValueError, match="no fp32 master"):
        FP32Masters(torch.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=1), {})
    other = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not float32 of the same shape"):
        FP32Masters(torch.optim.SGD([other], lr=1), {other: torch.ones(3)})


def test_stochastic_rounding_serves_the_masters_in_expectation_and_resumes_exactly():
    """master_rounding="stochastic": a bf16 weight whose master sits 1/8 of a bf16 step above it is served as
    the step above one time in eight (rounding to nearest: never), unbiased for negative values alike, within
    one bf16 step of the master; the random state is checkpointed, so a resumed run rounds as it would
    have; fp16 parameters round to nearest."""
    from colo.mixed_precision import MasterRounding

    rounding = MasterRounding("stochastic", seed=0)
    master = torch.full((100_000,), 1.0 + 2 ** -10)   # 1 and a 1/8 of bf16's step at 1 (2^-7)
    up, down = torch.empty(100_000, dtype=torch.bfloat16), torch.empty(100_000, dtype=torch.bfloat16)
    rounding.write([up, down], [master, -master])
    assert set(up.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert float((up.float() == 1.0 + 2 ** -7).float().mean()) == pytest.approx(1 / 8, abs=0.01)
    assert float(down.float().mean()) == pytest.approx(-(1.0 + 2 ** -10), abs=1e-4)
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    served = torch.empty(100_000, dtype=torch.bfloat16)
    rounding.write([served], [values])
    assert float((served.float() - values).abs().max()) < float(values.abs().max()) * 2 ** -7
    assert abs(float((served.float() - values).mean())) < 1e-4
    nearest = torch.empty(100_000, dtype=torch.bfloat16)
    MasterRounding("nearest").write([nearest], [master])
    assert torch.equal(nearest, master.to(torch.bfloat16))
    half = torch.empty(4, dtype=torch.float16)
    rounding.write([half], [values[:4]])
    assert torch.equal(half, values[:4].half())

    model = tiny_model(torch.bfloat16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, rounding="stochastic", seed=3)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))

    def step():
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step()
    saved = copy.deepcopy(opt.state_dict())
    step()
    after_two = [p.detach().clone() for p in model.parameters()]
    opt.load_state_dict(saved)
    step()
    assert all(torch.equal(p.detach(), expected) for p, expected in zip(model.parameters(), after_two))
    # rounded stochastically, not to nearest: some weights sit a bf16 step from their masters' nearest
    assert any(not torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(model.parameters(), opt.masters))
    with pytest.raises(ValueError, match="rounding must be one of nearest, stochastic"):
        MasterWeightOptimizer(model.parameters(), rounding="up")


def test_zero1_rounds_as_one_process_does():
    """ShardedMasterWeightOptimizer(rounding="stochastic") draws each parameter's rounding as the unsharded
    optimizer does (from the seed, the write and the parameter): on one rank the two give the same weights
    after the same steps, which are not the masters' nearest bf16 values."""
    from colo.zero import ShardedMasterWeightOptimizer

    models = [tiny_model(torch.bfloat16) for _ in range(2)]
    optimizers = [MasterWeightOptimizer(models[0].parameters(), torch.optim.AdamW, lr=1e-4, rounding="stochastic",
                                        seed=7),
                  ShardedMasterWeightOptimizer(models[1].parameters(), torch.optim.AdamW, lr=1e-4,
                                               rounding="stochastic", seed=7)]
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        for model, opt in zip(models, optimizers):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(p.detach(), m.to(torch.bfloat16))
               for p, m in zip(models[0].parameters(), optimizers[0].masters))
