"""Every model family colo tests, dense and MoE, through one copy of the weights: a tiny random model of
each (hidden 128, 2 layers, head_dim 64; MoE: 4 experts of width 64, 2 per token), one engine per family
for all of its checks:

- the trainer (colo.shared_model) and the engine give the same log-probabilities, and every trainer
  parameter is a view of an engine tensor (nothing copied, MoE experts included), except those whose
  engine values vLLM's loader computes (Falcon's fused QKV, reordered; Llama 4's q and k, permuted): read
  once from the checkpoint, handed to the loader on each publish;
- after an optimizer step and publish() the engine's log-probabilities follow the trainer's, 0 bytes
  copied (CPU kernels' packed copies, the MoE experts' included, repacked in place) beyond those;
- the trained weights saved in Hugging Face format (what OUT/final holds) load in transformers with
  the trained values.
"""
from __future__ import annotations

import json

import pytest
import torch

import colo
from colo.bench.models import ARCHITECTURES, MOE_ARCHITECTURES
from colo.moe_routing import is_moe
from colo.engine import release_llm, weights_region
from conftest import PROMPTS
from conftest import TINY_CONFIG as TINY
from helpers.logprobs import trainer_logprobs

pytestmark = pytest.mark.slow

# Families vLLM's CPU backend serves in bf16 only (its linear attention computes in bf16).
BF16_ONLY = ("qwen3_next",)
# Families whose checkpoints tie the LM head to the embedding (vLLM's Cohere always does).
TIED = ("gemma2", "gemma3", "gemma4", "gemma4_moe", "smollm3", "cohere", "bloom")
# Families vLLM does not serve with the embeddings tied the other way, and what refuses them: vLLM itself
# (Gemma 2's and BLOOM's heads are always the embedding, so an untied checkpoint's lm_head has no place in
# their loaders; GPT-J asserts untied embeddings) or colo (vLLM's Cohere would serve its embedding as the
# head, ignoring the checkpoint's lm_head: another model than the trainer's).
UNSERVED_OTHER_TIE = {"gemma2": "There is no module or parameter named 'lm_head'",
                      "bloom": "There is no module or parameter named 'lm_head'", "gptj": "",
                      "cohere": "lm_head.weight: the Hugging Face model has this parameter .* the engine has no place"}
# (family, dtype, tie_word_embeddings): every family as its checkpoints come, then with the embeddings tied
# the other way (where vLLM keeps an LM head of its own beside a tied one, OLMoE's, publish() fills it from
# the embedding).
CASES = [(arch, "float32", arch in TIED) for arch in ARCHITECTURES if arch not in BF16_ONLY] + \
    [("qwen3_moe", "bfloat16", False), ("gemma3", "bfloat16", True), ("qwen3_next", "bfloat16", False)] + \
    [(arch, "bfloat16" if arch in BF16_ONLY else "float32", arch not in TIED) for arch in ARCHITECTURES
     if arch not in UNSERVED_OTHER_TIE]
# The largest gap between the engine's and the trainer's log-probabilities, by dtype: rounding only.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.06}
# The parameters (by name ending) whose engine values vLLM's loader computes, per family: the copy path
# (Falcon's and BLOOM's fused QKV, reordered per KV group / head; Llama 4's q and k, permuted for vLLM's rope).
THROUGH_LOADER = {"falcon": ("self_attention.query_key_value.weight",),
                  "bloom": ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias"),
                  "llama4": ("self_attn.q_proj.weight", "self_attn.k_proj.weight")}
# The parameters (by name ending) the engine holds in another dtype than the trainer's, per family: copied.
COPIED = {"qwen3_next": {"linear_attn.A_log": torch.float32}}
# Config fields a family needs beside the tiny config: MLA has no grouped KV heads (each head's key and
# value come from the shared latent), so transformers' DeepSeek-V3 wants as many KV heads as heads.
FAMILY_FIELDS = {"deepseek_v3": dict(num_key_value_heads=2)}


def train_one_step(model) -> None:
    """One AdamW step on a language-modelling loss (a large rate: the step visibly moves what is served)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([list(range(3, 40))])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def test_every_family_is_tested():
    dense = [a for a in ARCHITECTURES if a not in MOE_ARCHITECTURES]
    assert len(dense) >= 10 and len(MOE_ARCHITECTURES) >= 4


def engine_keeps_its_own_head(llm) -> bool:
    """Whether the engine's LM head is a tensor of its own, not its embedding's."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = list(colo.vllm_compat.engine_model(llm).modules())
    heads = [m.weight for m in modules if isinstance(m, ParallelLMHead)]
    embeddings = [m.weight for m in modules
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    return bool(heads) and all(h.data_ptr() != e.data_ptr() for h in heads for e in embeddings)


def case_id(arch: str, dtype: str, tied: bool) -> str:
    return f"{arch}-{dtype}" + ("" if tied == (arch in TIED) else "-tied" if tied else "-untied")


@pytest.mark.parametrize("arch,dtype,tied", CASES, ids=[case_id(*case) for case in CASES])
def test_one_copy_serves_and_trains(arch, dtype, tied, tiny_model_dir, build_engine, prompt_logprobs, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch, vocab_size=1000, tie_word_embeddings=tied, **FAMILY_FIELDS.get(arch, {}))
    llm = build_engine(path, dtype=dtype)
    try:
        shared = colo.shared_model(llm)   # checks the log-probabilities itself (colo.share_check)
        model = shared.hf_model
        tolerance = TOLERANCE[dtype]
        before = prompt_logprobs(llm)
        assert (before - trainer_logprobs(model, PROMPTS)).abs().max() < tolerance
        region = weights_region(llm)
        through_loader = THROUGH_LOADER.get(arch, ())
        loaded = {n: p for n, p in model.named_parameters() if n.endswith(through_loader)}
        assert len(loaded) == model.config.num_hidden_layers * len(through_loader)
        # Copied besides: what the engine keeps in another dtype than the trainer (Qwen3-Next's fp32 A_log).
        in_engine = COPIED.get(arch, {})
        copied = {n: p.numel() * in_engine[end].itemsize for n, p in model.named_parameters()
                  for end in in_engine if n.endswith(end)}
        if tied and engine_keeps_its_own_head(llm):   # filled from the tied embedding (vLLM's OLMoE)
            copied["lm_head.weight"] = model.get_input_embeddings().weight.nbytes
        assert set(shared.copied) == set(loaded) | set(copied)
        assert shared.copy_bytes == sum(p.nbytes for p in loaded.values()) + sum(copied.values())
        assert all(region.contains(p) for n, p in model.named_parameters() if n not in loaded and n not in copied)
        if arch in MOE_ARCHITECTURES:
            experts = [n for n, _ in model.named_parameters() if "experts" in n]
            assert experts and shared.aliased_bytes == sum(p.nbytes for n, p in model.named_parameters()
                                                           if n not in loaded and n not in copied)
            assert is_moe(model)  # its routers found: routing replay and router_mismatch

        train_one_step(model)
        report = shared.publish()
        after = prompt_logprobs(llm)
        trained = trainer_logprobs(model, PROMPTS)
        assert report["bytes_copied"] == shared.copy_bytes and report["aliased_bytes"] == shared.aliased_bytes
        assert (after - trained).abs().max() < tolerance
        assert (after - before).abs().max() > 10 * tolerance   # the step changed what the engine serves

        saved = shared.write_pretrained(tmp_path / "final", shared.full_state_dict(), base_dir=path)
        # (In this process vLLM's Transformers backend has decorated OLMo-2's and SmolLM3's classes; a
        # user loads the saved model in a process of its own.)
        with colo.vllm_compat.building_trainer_models():
            reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=getattr(torch, dtype))
        mine = dict(model.named_parameters())
        for name, value in reloaded.named_parameters():
            torch.testing.assert_close(value, mine[name].detach(), atol=0, rtol=0, msg=name)
    finally:
        release_llm(llm)



@pytest.mark.parametrize("arch", sorted(UNSERVED_OTHER_TIE))
def test_a_tie_vllm_does_not_serve_is_refused(arch, tiny_model_dir, build_engine):
    """A family tied the other way than vLLM's model of it can be is refused before training: by vLLM's own
    loader, or by colo where vLLM would serve another model (its embedding as the head)."""
    path = tiny_model_dir(arch, vocab_size=1000, tie_word_embeddings=arch not in TIED)
    with pytest.raises((ValueError, AssertionError), match=UNSERVED_OTHER_TIE[arch]):
        llm = build_engine(path)
        try:
            colo.shared_model(llm)
        finally:
            release_llm(llm)


def test_a_routers_saved_score_correction_is_the_engines(build_engine, tmp_path):
    """GLM-4.5's router (as DeepSeek-V3's) picks experts by score plus `e_score_correction_bias`, a buffer
    saved with the weights: the trainer's is a view of the engine's tensor, in the saved model too. A
    correction larger than the scores decides the routing, so a trainer without it would not compute
    what the engine serves (share_weights' check would refuse it)."""
    from colo.bench.models import random_model

    model = random_model({**TINY, "vocab_size": 1000, "tie_word_embeddings": False}, arch="glm4_moe")
    torch.manual_seed(1)
    correction = {n: torch.randn_like(b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    assert len(correction) == 1
    for name, value in correction.items():
        model.get_buffer(name).copy_(value)
    model.save_pretrained(tmp_path / "base")
    llm = build_engine(tmp_path / "base")
    try:
        shared = colo.shared_model(llm)   # the log-probabilities agree: the correction is there
        region = weights_region(llm)
        for name, value in correction.items():
            buffer = shared.hf_model.get_buffer(name)
            assert region.contains(buffer) and torch.equal(buffer, value)
        state = shared.full_state_dict()
        assert all(torch.equal(state[name], value) for name, value in correction.items())
    finally:
        release_llm(llm)


def test_mla_absorbed_weights_follow_each_publish(build_engine, prompt_logprobs, tmp_path):
    """DeepSeek-V2's MLA attention decodes with W_UV and W_UK_T, which vLLM takes from kv_b_proj's weight
    after loading: no trainer parameter fills them, but they are views of that weight, so they follow the
    trainer's kv_b_proj (0 bytes copied). The engine serves what the trainer computes (share_weights' own
    check; on a CPU only with vLLM's rotary op off, colo.vllm_compat.native_rope_options), and after a step
    exactly what a fresh engine of the saved weights serves."""
    import transformers

    config = transformers.DeepseekV2Config(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, topk_group=1, n_group=1,
        # kv_lora_rank + qk_rope_head_dim = 320: a head size vLLM's MLA takes
        kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None,
        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    transformers.DeepseekV2ForCausalLM._from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "base")
    llm = build_engine(tmp_path / "base")
    try:
        shared = colo.shared_model(llm)  # the trainer's log-probabilities checked against the engine's
        model = shared.hf_model
        assert shared.copy_bytes == 0 and shared.copied == {}
        attention = [m for m in colo.vllm_compat.engine_model(llm).modules() if hasattr(m, "W_UV")]
        assert len(attention) == 2
        absorbed = attention[0].W_UV.detach().clone()
        before = prompt_logprobs(llm)

        train_one_step(model)
        report = shared.publish()
        after = prompt_logprobs(llm)
        assert report["bytes_copied"] == 0
        assert not torch.equal(attention[0].W_UV, absorbed)   # a view of the trained kv_b_proj
        assert (after - before).abs().max() > 1e-2
        saved = shared.write_pretrained(tmp_path / "final", shared.full_state_dict(), base_dir=tmp_path / "base")
    finally:
        release_llm(llm)
    fresh = build_engine(saved)
    try:
        assert (after - prompt_logprobs(fresh)).abs().max() < 1e-5
        # Decoding (what colo.grpo needs) either works or is refused in words, whichever this CPU's vLLM
        # MLA backend does (its reference kernel refuses the 16-token blocks vLLM gives it).
        refusal = colo.vllm_compat.decode_refusal(fresh)
        assert refusal is None or "cannot decode this MLA model on this CPU" in refusal
    finally:
        release_llm(fresh)


def test_the_cpu_rotary_op_is_off_for_mla_models_only_and_the_users_choice_wins(tmp_path):
    from colo.vllm_compat import native_rope_options

    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "config.json").write_text(json.dumps({"model_type": "deepseek_v2", "kv_lora_rank": 512}))
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    off = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    assert native_rope_options(tmp_path / "mla", "cpu", {}) == off
    assert native_rope_options(tmp_path / "mla", "cpu", {"compilation_config": {"mode": 0}}) == \
        {"compilation_config": {"mode": 0, "custom_ops": ["-rotary_embedding"]}}
    kept = {"compilation_config": {"custom_ops": ["+rotary_embedding"]}}
    assert native_rope_options(tmp_path / "mla", "cpu", kept) == kept
    assert native_rope_options(tmp_path / "mla", "cuda", {}) == {}
    assert native_rope_options(tmp_path / "dense", "cpu", {}) == {}


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


def test_an_engine_copy_colo_does_not_refresh_is_refused_at_share_time(tiny_model_dir, build_engine):
    """A copy of the weights an engine kernel keeps and colo does not refresh at publish (here: the oneDNN
    linears' packed copies, their repacking dropped) serves the old values after the first step; the check
    at share time publishes a changed model (every weight negated, then restored exactly) and refuses."""
    from colo.share_check import check_engine_follows

    llm = build_engine(tiny_model_dir("qwen2", vocab_size=1000), kernel="onednn")
    try:
        shared = colo.shared_model(llm)   # follows: the check passed
        model = shared.hf_model
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        shared._repack = []   # what a kernel colo does not know would leave stale
        with pytest.raises(ValueError, match="after a publish the engine does not serve what the trainer"):
            check_engine_follows(shared, model, llm)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())   # restored exactly
    finally:
        release_llm(llm)
