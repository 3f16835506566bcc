"""Every model family colo tests, dense and MoE, through one copy of the weights: a tiny random model of
each (hidden 128, 2 layers, head_dim 64; MoE: 4 experts of width 64, 2 per token), one engine per family
for all of its checks:

- the trainer (colo.shared_model) and the engine give the same log-probabilities, and every trainer
  parameter is a view of an engine tensor (nothing copied, MoE experts included);
- after an optimizer step and publish() the engine's log-probabilities follow the trainer's, 0 bytes
  copied (CPU kernels' packed copies, the MoE experts' included, repacked in place);
- the trained weights saved in Hugging Face format (what OUT/final holds) load in transformers with
  the trained values.
"""
from __future__ import annotations

import pytest
import torch

import colo
from colo.bench.models import ARCHITECTURES, MOE_ARCHITECTURES
from colo.engine import release_llm, weights_region
from conftest import PROMPTS
from helpers.logprobs import trainer_logprobs

pytestmark = pytest.mark.slow

CASES = [(arch, "float32") for arch in ARCHITECTURES] + [("qwen3_moe", "bfloat16"), ("gemma3", "bfloat16")]
# The largest gap between the engine's and the trainer's log-probabilities, by dtype: rounding only.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.06}


def test_every_family_is_tested():
    dense = [a for a in ARCHITECTURES if a not in MOE_ARCHITECTURES]
    assert len(dense) >= 10 and len(MOE_ARCHITECTURES) >= 4


@pytest.mark.parametrize("arch,dtype", CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_one_copy_serves_and_trains(arch, dtype, tiny_model_dir, build_engine, prompt_logprobs, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch, vocab_size=1000, tie_word_embeddings=arch in ("gemma2", "gemma3", "smollm3"))
    llm = build_engine(path, dtype=dtype)
    try:
        shared = colo.shared_model(llm)   # checks the log-probabilities itself (colo.share_check)
        model = shared.hf_model
        tolerance = TOLERANCE[dtype]
        before = prompt_logprobs(llm)
        assert (before - trainer_logprobs(model, PROMPTS)).abs().max() < tolerance
        region = weights_region(llm)
        assert shared.copy_bytes == 0 and shared.copied == {}
        assert all(region.contains(p) for p in model.parameters())
        if arch in MOE_ARCHITECTURES:
            experts = [n for n, _ in model.named_parameters() if "experts" in n]
            assert experts and shared.aliased_bytes == sum(p.nbytes for p in model.parameters())

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.tensor([list(range(3, 40))])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        report = shared.publish()
        after = prompt_logprobs(llm)
        trained = trainer_logprobs(model, PROMPTS)
        assert report["bytes_copied"] == 0 and report["aliased_bytes"] == shared.aliased_bytes
        assert (after - trained).abs().max() < tolerance
        assert (after - before).abs().max() > 10 * tolerance   # the step changed what the engine serves

        saved = shared.write_pretrained(tmp_path / "final", shared.full_state_dict(), base_dir=path)
        # (In this process vLLM's Transformers backend has decorated OLMo-2's and SmolLM3's classes; a
        # user loads the saved model in a process of its own.)
        with colo.vllm_compat.building_trainer_models():
            loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=getattr(torch, dtype))
        mine = dict(model.named_parameters())
        for name, value in loaded.named_parameters():
            torch.testing.assert_close(value, mine[name].detach(), atol=0, rtol=0, msg=name)
    finally:
        release_llm(llm)



@pytest.mark.parametrize("arch", ["gemma3", "olmo2"])
def test_lora_adapter_is_the_engines_slot(arch, tiny_model_dir, build_engine, prompt_logprobs, tmp_path):
    """LoRA beyond Llama and Qwen: the adapter trains in the engine's slot, 0 bytes per publish (Gemma 3
    with vLLM's own model, OLMo-2 through vLLM's Transformers backend)."""
    from colo.lora import LoraSpec, share_adapter

    spec = LoraSpec(rank=4, alpha=16)
    llm = build_engine(tiny_model_dir(arch, vocab_size=1000, tie_word_embeddings=arch == "gemma3"),
                       **spec.engine_options())
    try:
        model = colo.shared_model(llm).hf_model
        base = prompt_logprobs(llm)
        adapter = share_adapter(model, llm, spec, tmp_path)
        assert len(adapter.layers) == 7 * model.config.num_hidden_layers
        optimizer = colo.MasterWeightOptimizer(adapter.parameters(), torch.optim.AdamW, lr=1e-2,
                                               scales=adapter.scales())
        ids = torch.tensor([list(range(3, 40))])
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        report = adapter.publish()
        served = prompt_logprobs(llm, lora_request=adapter.request)
        assert report["bytes_copied"] == 0
        assert (served - trainer_logprobs(model, PROMPTS)).abs().max() < TOLERANCE["float32"]
        assert (served - base).abs().max() > 10 * TOLERANCE["float32"]
    finally:
        release_llm(llm)
