"""LoRA with one copy (colo.lora): the trainer's adapter is the engine's adapter slot, the base is the
engine's weights, and the engine serves what the trainer trains with 0 bytes per publish."""
from __future__ import annotations

import pytest
import torch

import colo
import colo.shared
from colo.engine import release_llm
from colo.lora import LoraSpec, read_adapter, share_adapter

from conftest import PROMPTS, load_hf_model
from helpers.logprobs import trainer_logprobs

# Log-probability tolerances as in test_weights.CASES: fp32 sums of a few hundred terms (1e-4), and
# a bf16 engine against a bf16 trainer whose GEMMs round in another order (2e-2).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def train_steps(model, optimizer, steps=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def lora_engine(tiny_model_dir, build_engine):
    """Factory: lora_engine(spec, dtype) -> (model dir, llm, trainer model with the base shared)."""
    def make(spec: LoraSpec, dtype: str):
        path = tiny_model_dir("qwen2", vocab_size=1000)
        llm = build_engine(path, dtype=dtype, **spec.engine_options())
        return path, llm, colo.shared_model(llm).hf_model
    return make


@pytest.mark.slow
@pytest.mark.cpu_kind
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_serves_the_adapter_the_trainer_trains_with_one_copy(dtype, tmp_path, lora_engine, prompt_logprobs):
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    spec = LoraSpec(rank=4, alpha=16)  # rank 4 sits in vLLM's rank-8 slots: B is a strided view
    path, llm, model = lora_engine(spec, dtype)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    served_base = prompt_logprobs(llm)
    adapter = share_adapter(model, llm, spec, tmp_path)
    from colo import vllm_compat as compat  # the CPU engine serves the one adapter on the fast path
    from colo.vllm_compat.lora_slots import _one_adapter_punica_cpu

    assert {type(w) for w in compat.punica_wrappers(llm)} == {_one_adapter_punica_cpu()}

    weights = colo.engine.weights_region(llm)
    assert adapter.parameters() and all(weights.contains(p) for p in adapter.parameters())
    assert [n for n, p in model.named_parameters() if p.requires_grad] == \
        [f"{name}.lora_{x}" for name in adapter.layers for x in "AB"]
    assert len(adapter.layers) == 7 * model.config.num_hidden_layers
    # B starts at zero: the adapter changes nothing yet.
    torch.testing.assert_close(prompt_logprobs(llm, lora_request=adapter.request), served_base, atol=0, rtol=0)

    optimizer = colo.MasterWeightOptimizer(adapter.parameters(), torch.optim.AdamW, lr=1e-2,
                                           scales=adapter.scales())
    ptrs = [p.data_ptr() for p in adapter.parameters()]
    train_steps(model, optimizer)
    report = adapter.publish()
    assert report["bytes_copied"] == 0 and [p.data_ptr() for p in adapter.parameters()] == ptrs
    # one contract (colo.shared): the same report as every kind's, the adapter's bytes aliased, not copied
    assert isinstance(report, colo.shared.PublishReport)
    assert report.adapter_bytes == report.aliased_bytes == sum(p.nbytes for p in adapter.parameters()) > 0
    served = prompt_logprobs(llm, lora_request=adapter.request)
    torch.testing.assert_close(served, trainer_logprobs(model, PROMPTS), atol=TOLERANCE[dtype], rtol=0)
    assert (served - served_base).abs().max() > 10 * TOLERANCE[dtype], "the adapter should change outputs"
    for name, p in model.named_parameters():  # the base is frozen and untouched, bit for bit
        if name in base:
            assert torch.equal(p, base[name]), name
    torch.testing.assert_close(prompt_logprobs(llm), served_base, atol=0, rtol=0)  # no adapter: the base

    # PEFT's format: B / (alpha / rank). Merged into the base the PEFT way (W + alpha/rank B A), and
    # loaded by PEFT, it gives the served log-probabilities; a stock engine loading it from disk too.
    adapter.save_pretrained(tmp_path / "peft")
    read_spec, tensors = read_adapter(tmp_path / "peft")
    assert read_spec == spec
    merged = load_hf_model(path, torch.float32)
    with torch.no_grad():
        for name, module in merged.named_modules():
            if f"base_model.model.{name}.lora_A.weight" in tensors:
                a = tensors[f"base_model.model.{name}.lora_A.weight"].float()
                b = tensors[f"base_model.model.{name}.lora_B.weight"].float()
                module.weight += spec.scaling * b @ a
    torch.testing.assert_close(trainer_logprobs(merged, PROMPTS), served, atol=TOLERANCE[dtype], rtol=0)
    from peft import PeftModel  # PEFT itself loads it onto the base

    loaded = PeftModel.from_pretrained(load_hf_model(path, torch.float32), tmp_path / "peft")
    torch.testing.assert_close(trainer_logprobs(loaded, PROMPTS), served, atol=TOLERANCE[dtype], rtol=0)
    stock = LLM(model=str(path), dtype=dtype, seed=0, max_model_len=256, skip_tokenizer_init=True,
                kv_cache_memory_bytes=16 << 20, enforce_eager=True, **spec.engine_options())
    try:
        from_disk = prompt_logprobs(stock, lora_request=LoRARequest("exported", 7, str(tmp_path / "peft")))
    finally:
        release_llm(stock)
    torch.testing.assert_close(from_disk, served, atol=TOLERANCE[dtype], rtol=0)


def test_the_master_optimizer_steps_scaled_parameters_as_their_unscaled_selves():
    """A parameter holding s x w (vLLM's LoRA B) trains as w would with AdamW, clipping and weight decay."""
    torch.manual_seed(0)
    s = 4.0
    w_ref = torch.nn.Parameter(torch.randn(8, 3))
    a_ref = torch.nn.Parameter(torch.randn(3, 5))
    w = torch.nn.Parameter(w_ref.detach() * s)
    a = torch.nn.Parameter(a_ref.detach().clone())
    ref = torch.optim.AdamW([a_ref, w_ref], lr=1e-2, weight_decay=0.1)
    opt = colo.MasterWeightOptimizer([a, w], torch.optim.AdamW, lr=1e-2, weight_decay=0.1, scales={a: 1.0, w: s})
    for step in range(5):
        x = torch.randn(4, 5)
        (x @ a_ref.T @ (s * w_ref).T).square().sum().backward()
        norm_ref = float(torch.nn.utils.clip_grad_norm_([a_ref, w_ref], 0.5))
        ref.step()
        ref.zero_grad()
        (x @ a.T @ w.T).square().sum().backward()
        assert opt.clip_grad_norm_(0.5) == pytest.approx(norm_ref, rel=1e-5)
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(a, a_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, s * w_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_one_adapter_fast_path_computes_what_vllms_cpu_lora_ops_compute(prefill, dtype):
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from colo.vllm_compat.lora_slots import _one_adapter_punica_cpu

    generator = torch.Generator().manual_seed(0)
    slot_ids, rank, hidden, slices = [10, 20], 8, 32, (24, 8, 8)  # a fused q/k/v layer, two slots
    lora_a = tuple(torch.randn(2, 1, rank, hidden, generator=generator).to(dtype) for _ in slices)
    lora_b = tuple(torch.randn(2, 1, size, rank, generator=generator).to(dtype) for size in slices)
    x = torch.randn(5, hidden, generator=generator).to(dtype)
    y_before = torch.randn(5, sum(slices), generator=generator).to(dtype)

    def lora_linear(wrapper_class, token_ids):
        wrapper = wrapper_class(16, 4, "cpu")
        wrapper.update_metadata(LoRAMapping(token_ids, token_ids, is_prefill=prefill), slot_ids, 2, 100)
        y = y_before.clone()
        wrapper.add_lora_linear(y, x, lora_a, lora_b, 0.5, slices)
        return y, wrapper

    # Both compute fp32 x @ A.T and round the same products to y's dtype; only the order of the sums
    # differs: up to (32 + 8 terms) x 2^-24 relative in fp32, one bf16 rounding (2^-8) of the update.
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    for adapter in slot_ids:  # every token on one slot: the fast path
        fast, wrapper = lora_linear(_one_adapter_punica_cpu(), (adapter,) * 5)
        assert wrapper.single_slot == slot_ids.index(adapter)
        vllm_way, _ = lora_linear(PunicaWrapperCPU, (adapter,) * 5)
        assert not torch.allclose(fast, y_before)
        torch.testing.assert_close(fast, vllm_way, **tolerance)
    for mixed in [(10, 10, 20, 20, 20), (0, 0, 10, 10, 10)]:  # slots mixed, or tokens without an adapter
        fallback, wrapper = lora_linear(_one_adapter_punica_cpu(), mixed)
        assert wrapper.single_slot is None
        assert torch.equal(fallback, lora_linear(PunicaWrapperCPU, mixed)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_one_adapter_fast_path_adds_an_lm_heads_adapter_to_prompt_logprobs_rows(dtype):
    """vLLM's CPU LM-head LoRA indexes its slots by sampled token, so a prefill's prompt-logprobs rows
    (one per prompt token) fail there; with one slot for the batch, every row takes that slot, as
    vLLM computes a decode's rows; a batch of no adapter adds nothing."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from colo.vllm_compat.lora_slots import _one_adapter_punica_cpu

    generator = torch.Generator().manual_seed(0)
    slot_ids, rank, hidden, vocab = [10, 20], 8, 32, 48
    lora_a = torch.randn(2, 1, rank, hidden, generator=generator).to(dtype)
    lora_b = torch.randn(2, 1, vocab - 2, rank, generator=generator).to(dtype)   # the adapter pads less
    x = torch.randn(6, hidden, generator=generator).to(dtype)
    logits_before = torch.randn(6, vocab, generator=generator).to(dtype)

    def lm_head_lora(wrapper_class, token_ids, sampled_ids, rows):
        wrapper = wrapper_class(16, 4, "cpu")
        wrapper.update_metadata(LoRAMapping(token_ids, sampled_ids, is_prefill=True), slot_ids, 2, vocab)
        logits = logits_before[:rows].clone()
        wrapper.add_lora_logits(logits, x[:rows], lora_a, lora_b, 1.0)
        return logits

    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    # two requests of three prompt tokens on slot 20, their prompt logprobs: six rows, two sampled tokens
    fast = lm_head_lora(_one_adapter_punica_cpu(), (20,) * 6, (20, 20), 6)
    with pytest.raises(RuntimeError):
        lm_head_lora(PunicaWrapperCPU, (20,) * 6, (20, 20), 6)
    torch.testing.assert_close(fast, lm_head_lora(PunicaWrapperCPU, (20,) * 6, (20,) * 6, 6), **tolerance)
    assert torch.equal(fast[:, vocab - 2:], logits_before[:, vocab - 2:])
    assert not torch.allclose(fast, logits_before)
    assert torch.equal(lm_head_lora(_one_adapter_punica_cpu(), (0,) * 6, (0, 0), 6), logits_before)


def test_scales_must_name_every_parameter():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="scales must name every parameter"):
        colo.MasterWeightOptimizer([a, b], scales={a: 1.0})
    with pytest.raises(TypeError, match="fp32 masters of bfloat16/float16"):
        colo.MasterWeightOptimizer([a, b])  # fp32 without scales: train them directly


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "rank must be an int in"), (dict(rank=513), "rank must be an int in"),
    (dict(rank=2.0), "rank must be an int in"), (dict(rank=8, alpha=0), "alpha must be a number > 0"),
    (dict(rank=8, targets=("model.q_proj",)), "targets must be module names"),
    (dict(rank=8, targets=()), "targets must be module names"), (dict(rank=8, dropout=1.0), "dropout must be in"),
])
def test_bad_lora_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraSpec(**kwargs)


def test_slot_ranks_are_the_smallest_vllm_allows():
    assert LoraSpec(rank=4).engine_options()["max_lora_rank"] == 8
    assert LoraSpec(rank=16).engine_options()["max_lora_rank"] == 16
    assert LoraSpec(rank=300).engine_options()["max_lora_rank"] == 320
    assert LoraSpec(rank=4, targets="q_proj").targets == ("q_proj",)


@pytest.mark.slow
def test_an_adapter_is_refused_where_it_cannot_be_shared(tmp_path, lora_engine, tiny_engine):
    spec = LoraSpec(rank=8)
    with pytest.raises(RuntimeError, match="without enable_lora=True"):
        share_adapter(colo.shared_model(tiny_engine).hf_model, tiny_engine, spec, tmp_path)
    _, llm, model = lora_engine(spec, "float32")
    with pytest.raises(ValueError, match="no linear layer of the model is named one of"):
        share_adapter(model, llm, LoraSpec(rank=8, targets=("attn_proj",)), tmp_path)
