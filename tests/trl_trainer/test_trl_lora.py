"""colo.trl with a PEFT LoRA model: a TRL script with `peft_config=LoraConfig(...)` trains with one copy
of the base (the engine's weights, frozen) and the adapter in the engine's LoRA slot (PEFT's lora_A /
lora_B are views of it), 0 bytes per sync, no load_weights and no adapter load after start."""
from __future__ import annotations

import pytest
import torch
import transformers

import colo
from colo.vllm_compat import engine_model, engine_worker
from conftest import PROMPTS
from helpers.logprobs import trainer_logprobs
from helpers.spies import count_calls

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl", reason="colo.trl's tests need the trl extra: pip install -e '.[cpu,test]'")
peft = pytest.importorskip("peft", reason="colo.trl's LoRA tests need PEFT: pip install -e '.[cpu,test]'")
from colo.bench.trl_colocate import SIZES, build_model_dir, even_digits, prompts  # noqa: E402 - after the checks
from helpers.peft_runs import TARGETS, lora_config  # noqa: E402
from test_trl import trl_config  # noqa: E402


@pytest.fixture(scope="module")
def trl_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl-lora-model")
    build_model_dir(path, SIZES["qwen2-trl-0.4M"])
    return path


@pytest.mark.cpu_kind
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_trl_script_with_a_peft_lora_config_trains_the_engines_adapter_slot(dtype, tmp_path, trl_model_dir,
                                                                               prompt_logprobs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from colo.trl import GRPOTrainer

    # beta > 0: TRL's reference is the PEFT model with its adapter disabled (the shared base).
    config = trl_config(tmp_path, "auto", learning_rate=2e-2, beta=0.04, save_strategy="steps", save_steps=3)
    trainer = GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=prompts().select(range(64)),
                          args=config, colo_engine_dtype=dtype, peft_config=lora_config())
    generation = trainer.vllm_generation
    llm, adapter = generation.llm, generation.colo_views
    model = trainer.accelerator.unwrap_model(trainer.model)
    engine_dtype = getattr(torch, dtype)
    # One copy: the base is the engine's weights, the adapter the engine's slot (rank 4 in vLLM's rank-8 slots).
    assert {p.dtype for p in model.parameters()} == {engine_dtype}
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    assert trainer.colo_shared.aliased_bytes == adapter.weights.aliased_bytes == sum(p.nbytes for p in base.values())
    weights = colo.engine.weights_region(llm)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(TARGETS) * model.config.num_hidden_layers
    assert {id(p) for p in trainable} == {id(p) for p in adapter.parameters()}
    assert all(weights.contains(p) for p in trainable)
    base_before = {n: p.detach().clone() for n, p in base.items()}
    loads = count_calls(engine_model(llm), "load_weights")
    adapter_loads = count_calls(engine_worker(llm).model_runner.lora_manager, "_load_adapter")
    ptrs = [p.data_ptr() for p in trainable]
    trainer.train()

    assert loads == [] and adapter_loads == [], "a sync went through load_weights or reloaded the adapter"
    reports = generation.colo_sync_reports
    assert len(reports) >= 2 and all(r["bytes_copied"] == 0 and r["reshared_bytes"] == 0 for r in reports)
    assert [p.data_ptr() for p in trainable] == ptrs
    for name, p in base.items():  # frozen, bit for bit
        assert torch.equal(p, base_before[name]), name
    # Training memory is the adapter's: fp32 masters and AdamW's two moments, 12 bytes per adapter value.
    masters = trainer.colo_fp32_masters
    state = [t for s in masters.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    numel = sum(p.numel() for p in trainable)
    assert sum(t.nbytes for t in state) + sum(m.nbytes for m in masters.masters) == 12 * numel
    # The slot holds alpha/r x PEFT's B; the masters are PEFT's units, and the slot their rounding.
    scale = 16 / 4
    for p, master, s in zip(masters.params, masters.masters, masters.scales):
        assert s in (1.0, scale) and torch.equal(p.detach(), (master * s).to(engine_dtype))
    assert any(m.abs().max() > 0 for p, m in zip(masters.params, masters.masters) if p.shape[1] == 4), "B trained"

    tolerance = 1e-4 if dtype == "float32" else 5e-2  # as test_trl: bf16 GEMMs rounding in another order
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == 3 and max(h["sampling/sampling_logp_difference/max"] for h in history) < tolerance
    generation.sync_weights()
    served = prompt_logprobs(llm)  # a request naming no adapter: the trained model (base + adapter)
    torch.testing.assert_close(served, trainer_logprobs(model, PROMPTS), atol=tolerance, rtol=0)
    with model.disable_adapter():
        base_logprobs = trainer_logprobs(model, PROMPTS)
    assert (served - base_logprobs).abs().max() > 10 * tolerance, "the adapter should change outputs"

    # save_model writes PEFT's format in PEFT's units (the fp32 masters): PEFT loads it onto the base
    # and computes what the engine serves.
    trainer.save_model(str(tmp_path / "final"))
    fresh = AutoModelForCausalLM.from_pretrained(trl_model_dir, dtype=engine_dtype)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "final")
    torch.testing.assert_close(trainer_logprobs(reloaded, PROMPTS), served, atol=tolerance, rtol=0)
    assert (tmp_path / "out" / "checkpoint-3" / "adapter_model.safetensors").is_file()

    # Resuming: transformers loads the checkpoint's adapter (PEFT's B, written in place into the slot),
    # then the optimizer state, whose fp32 masters put alpha/r x B back: before the first step the
    # engine's slot holds the rounding of the saved masters, and training goes on from them.
    saved_masters = [m.detach().clone() for m in masters.masters]
    del trainer, generation, llm, adapter, model, masters
    resumed = GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits,
                          train_dataset=prompts().select(range(64)), colo_engine_dtype=dtype,
                          args=trl_config(tmp_path, "auto", learning_rate=2e-2, beta=0.04, max_steps=4),
                          peft_config=lora_config())
    at_start = []

    class Inspect(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            again = resumed.colo_fp32_masters
            at_start.append(all(torch.equal(m, saved) for m, saved in zip(again.masters, saved_masters)) and all(
                torch.equal(p.detach(), (m * s).to(engine_dtype)) for p, m, s in zip(again.params, again.masters, again.scales)))

    resumed.add_callback(Inspect())
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert at_start == [True], "the resumed slot is not the checkpoint's adapter"
    assert resumed.state.global_step == 4
    history = [h for h in resumed.state.log_history if "reward" in h]
    assert [h["step"] for h in history] == [1, 2, 3, 4]  # the checkpoint's log, then the resumed step
    assert history[-1]["sampling/sampling_logp_difference/max"] < tolerance
    from colo.lora import LoraSpec
    from colo.peft_format import write_adapter

    write_adapter(tmp_path / "rank8", LoraSpec(8, 16.0, tuple(TARGETS)), {})
    with pytest.raises(ValueError, match="rank 8, alpha 16.0; this trainer's is rank 4"):
        resumed._load_from_checkpoint(str(tmp_path / "rank8"))


def test_peft_options_colo_cannot_share_are_refused_before_an_engine_starts(tmp_path, trl_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from colo.lora import peft_lora_spec
    from colo.trl import GRPOTrainer

    def spec_of(**options):
        model = AutoModelForCausalLM.from_pretrained(trl_model_dir)
        options = {"r": 4, "target_modules": ["q_proj"], **options}
        return peft_lora_spec(get_peft_model(model, LoraConfig(**options)))

    assert spec_of(lora_alpha=8).rank == 4 and spec_of(lora_alpha=8).targets == ("q_proj",)
    for options, named in [({"use_dora": True}, "use_dora"), ({"bias": "lora_only"}, "bias"),
                           ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                           ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
                           ({"layers_to_transform": [0]}, "layers_to_transform")]:
        with pytest.raises(NotImplementedError, match=named):
            spec_of(**options)
    with pytest.raises(NotImplementedError, match="embeddings|Embedding"):
        spec_of(target_modules=["embed_tokens"])
    with pytest.raises(NotImplementedError, match="use_dora"):
        GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=prompts().select(range(8)),
                    args=trl_config(tmp_path, "auto"),
                    peft_config=LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))


def test_a_shared_peft_adapter_steps_as_peft_does(tmp_path, tiny_model_dir, build_engine):
    """The slot holds alpha/r x PEFT's B with the layer's scaling 1; B's gradient is scaled back as
    autograd makes it, and the masters are PEFT's values: a step with gradient clipping and weight
    decay on the shared adapter lands where the same step on an unshared PEFT model lands (fp32
    engine; SGD, whose update is linear in the gradient: Adam's first step divides by |g| + eps,
    which turns fp32 rounding of gradients near eps into differences of a whole learning rate)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from colo.lora import peft_base_layers, peft_lora_spec, share_peft_adapter
    from colo.optimizer_masters import FP32Masters
    from conftest import load_hf_model

    path = tiny_model_dir("qwen2", vocab_size=1000)
    torch.manual_seed(0)
    model = get_peft_model(load_hf_model(path), LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS,
                                                           init_lora_weights=False))  # B != 0 from the start
    reference = copy.deepcopy(model)
    llm = build_engine(path, **peft_lora_spec(model).engine_options())
    with peft_base_layers(model) as base:
        colo.share_weights(base, llm)
    adapter, masters = share_peft_adapter(model, llm, tmp_path)

    def step(peft_model, optimizer, clip):
        ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
        peft_model(input_ids=ids, labels=ids).loss.backward()
        clip(0.05)  # small: the clipping scale depends on the gradients' norm in PEFT's units
        optimizer.step()
        optimizer.zero_grad()

    masters_before = {n: masters[p].clone() for n, p in model.named_parameters() if p.requires_grad}
    trainable = [p for p in reference.parameters() if p.requires_grad]
    expected = torch.optim.SGD(trainable, lr=1.0, weight_decay=0.1)
    step(reference, expected, lambda c: torch.nn.utils.clip_grad_norm_(trainable, c))
    optimizer = torch.optim.SGD(adapter.parameters(), lr=1.0, weight_decay=0.1)
    shared = FP32Masters(optimizer, masters, scales=adapter.scales())
    step(model, optimizer, lambda c: torch.nn.utils.clip_grad_norm_(adapter.parameters(), c))

    named = dict(reference.named_parameters())
    master_of = {id(p): m for p, m in zip(shared.params, shared.masters)}
    got = {n: master_of[id(p)] for n, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == {n for n, p in named.items() if p.requires_grad}
    for name, value in got.items():
        torch.testing.assert_close(value, named[name].detach(), atol=1e-6, rtol=1e-5)
    assert max((got[n] - masters_before[n]).abs().max() for n in got) > 1e-3, "the step should move the adapter"
    assert adapter.publish()["bytes_copied"] == 0
