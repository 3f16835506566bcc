"""Randomly initialised causal LMs for the benchmarks and the tests: only their shapes matter.

Unless the config says otherwise: head_dim 64 (vLLM's CPU attention supports only some head sizes:
32, 64, 80, ...) and tied embeddings, as in the small Qwen2 models.
"""
from __future__ import annotations

from pathlib import Path

# name -> (config class, model class) in transformers: the families the tests build tiny models of,
# dense and MoE (vLLM 0.32 serves OLMo-2 and SmolLM3 through its Transformers backend, the others with
# its own models).
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"), "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"), "falcon": ("FalconConfig", "FalconForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"), "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"), "cohere": ("CohereConfig", "CohereForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"), "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"), "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"), "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM"),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
    "opt": ("OPTConfig", "OPTForCausalLM"), "bloom": ("BloomConfig", "BloomForCausalLM"), "gptj": ("GPTJConfig", "GPTJForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "glm4_moe", "deepseek_v3", "gpt_oss",
                     "llama4", "gemma4_moe", "ernie4_5_moe", "exaone_moe", "granitemoeshared", "qwen3_next")
_DEFAULTS = dict(head_dim=64, tie_word_embeddings=True)
# Fields a family names its own way: Falcon's grouped-query layout (Falcon-40B's and -180B's, whose fused
# QKV vLLM's loader reorders) and its KV head count; GPT-2's dropout, off so that a model in training mode
# computes what the engine serves.
FAMILY_DEFAULTS = {"falcon": dict(new_decoder_architecture=True, num_kv_heads=1),
                   "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                   "opt": dict(dropout=0.0), "gptj": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                   # Gemma 4's global layers' own head size (512 in the real ones), and its per-layer input
                   # embeddings over the tests' vocabularies (262144 rows by default)
                   "gemma4": dict(per_layer_config={"01": {"head_dim": 128}}, vocab_size_per_layer_input=1000,
                                  hidden_size_per_layer_input=64),
                   "gemma4_moe": dict(vocab_size_per_layer_input=1000, hidden_size_per_layer_input=64),
                   # MLA (kv_lora_rank + qk_rope_head_dim = 320: a head size vLLM's CPU MLA takes), and the
                   # router fields DeepSeek-V3's checkpoints carry and transformers' config lacks (vLLM reads
                   # them: without scoring_func it routes by softmax, transformers by sigmoid)
                   "deepseek_v3": dict(kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                       q_lora_rank=64, topk_method="noaux_tc", scoring_func="sigmoid")}
# A small MoE layer per family: 4 experts, 2 per token, expert width 64 (vLLM's CPU MoE kernel wants
# hidden and expert sizes divisible by 32; Mixtral's and OLMoE's experts take `intermediate_size`).
MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    # GLM-4.5's: a first dense layer, a shared expert, and a router with a saved score correction (as DeepSeek-V3's)
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                     n_shared_experts=1, topk_group=1, n_group=1),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                        n_shared_experts=1, topk_group=1, n_group=1),
    # GPT-OSS's: biased router and experts, top-k then softmax, attention sinks, sliding-window layers
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=64),
    # Llama 4's: one routed expert (sigmoid gate) and a shared one per layer; chunked attention (the chunk a
    # multiple of vLLM's 128-token CPU KV block, which vLLM asserts) in the rope layers, a NoPE layer every
    # second layer (every fourth in Llama 4 Scout's)
    "llama4": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=64, intermediate_size_mlp=256,
                   interleave_moe_layer_step=1, attention_chunk_size=128, no_rope_layer_interval=2),
    # Gemma 4's MoE (26B-A4B's): the experts beside the dense MLP in every layer
    "gemma4_moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=64),
    "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_group=1, topk_group=1),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                             shared_intermediate_size=128),
    # Qwen3-Next's: a shared expert, and Gated DeltaNet linear attention in every layer but each second one
    # (each fourth in the real ones), its heads a few
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                       full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=64, linear_value_head_dim=64),
}

# The rope table size (max_position_embeddings) of the random models the sections save: it is part of
# what vLLM compiles, so with one size a model shape compiles once per dtype and kernel for every
# section (a fresh machine's compile caches fill once). Sections that need longer sequences say so.
MAX_POSITIONS = 512

# name -> Qwen2 config fields of the model sizes the sections measure.
QWEN2_SIZES = {
    "qwen2-0.4M": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=512),
    "qwen2-9M": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=32000),
    "qwen2-45M": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=32000),
    "qwen2-120M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=50000),
    "qwen2-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),  # Qwen2-0.5B's shape: 494M parameters
}


# name -> Qwen3-MoE config fields: the MoE size the publish section measures (0.50B parameters, 32
# experts of width 384 per layer, 4 per token; head_dim 64).
MOE_SIZES = {
    "qwen3moe-0.5B": dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_experts=32,
                          num_experts_per_tok=4, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
                          vocab_size=32000),
}


def random_model(config: dict, *, arch: str = "qwen2", dtype=None, seed: int = 0):
    """A `arch` causal LM with the config fields `config`, initialised from `seed`, in `dtype`
    (default float32); initialised in that dtype, so a large bf16 model never exists in fp32."""
    import torch
    import transformers

    config_name, model_name = ARCHITECTURES[arch]
    config_class = getattr(transformers, config_name)
    fields = {**_DEFAULTS, **MOE_DEFAULTS.get(arch, {}), **FAMILY_DEFAULTS.get(arch, {}), **config}
    derived = {name: fields.pop(name) for name in list(fields) if _read_only(config_class, name)}
    special = _special_ids_within(config_class(), fields)
    model_config = config_class(**fields, **special)
    for name, value in derived.items():  # a field the family computes (Falcon's head_dim): it must come out so
        if getattr(model_config, name) != value:
            raise ValueError(f"{arch}: config.{name} comes out {getattr(model_config, name)!r}, not {value!r}")
    for name, value in special.items():  # some configs put their default back for None (GLM-4's eos list)
        setattr(model_config, name, value)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)._from_config(model_config, dtype=dtype or torch.float32)


def _read_only(config_class, name: str) -> bool:
    attribute = getattr(config_class, name, None)
    return isinstance(attribute, property) and attribute.fset is None


def _special_ids_within(defaults, fields: dict) -> dict:
    """The special token ids of a family's default config that fall outside the vocabulary `fields` give
    (those of its real vocabulary: Gemma's, OLMo's, GLM's), set to None, unless `fields` sets them."""
    vocab = fields.get("vocab_size", defaults.vocab_size)
    out = {}
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(defaults, name, None)
        ids = value if isinstance(value, list) else [value]
        if name not in fields and any(isinstance(i, int) and i >= vocab for i in ids):
            inside = [i for i in ids if isinstance(i, int) and i < vocab]
            out[name] = (inside if isinstance(value, list) and inside else inside[0] if inside else None)
    return out


def save_random_model(directory: Path, config: dict, **kwargs) -> int:
    """`random_model(config, **kwargs)` saved to `directory` with save_pretrained; returns its parameter count."""
    model = random_model(config, **kwargs)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())
