"""colo.trl on a vision-language model: TRL's image column and processor path, on colo's engine with one
copy of the weights; and stock TRL (colocate) on the same tiny model and batch (on the F.linear variant
where stock vLLM cannot take weights).

vLLM 0.32 expands the image placeholders of a token prompt again, so stock TRL's engine generates from
another prompt than the one it trains on; colo.trl sends the template's ids (colo.trl_vision), and the
engine's log-probabilities of what it sampled equal the trainer's.
"""
from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl", reason="colo.trl's tests need the trl extra: pip install -e '.[cpu,test]'")
from helpers.images import squares  # noqa: E402 - after the trl check
from helpers.stock_trl import stock_trl_environment  # noqa: E402
from helpers.trl_vision_runs import image_digests, run, stock_in_own_process  # noqa: E402


@pytest.fixture
def stock_trl_in_this_process():
    with stock_trl_environment():
        yield


# Each family's vision tower and projector, by a part of their parameters' names.
TOWER_AND_PROJECTOR = {"idefics3": (".vision_model.", ".connector."), "qwen2_5_vl": (".visual.blocks.", ".visual.merger.")}


@pytest.mark.parametrize("family", ["idefics3", "qwen2_5_vl"])
def test_trls_vision_language_path_runs_on_colos_engine_with_one_copy(family, idefics3_dir, tiny_vision_dir,
                                                                      tmp_path):
    model_dir = idefics3_dir if family == "idefics3" else tiny_vision_dir(family)
    stock_history, stock_seen = stock_in_own_process(model_dir, tmp_path)
    trainer, history, seen, changed = run("colo", model_dir, tmp_path)
    seen = image_digests(seen)

    # The same rows, images and metrics reach TRL's reward function and logs on both.
    assert seen == stock_seen and len(seen) == 8
    # (colo's own metric beside TRL's: the optimizer steps it skipped on gradients that were not finite)
    assert len(history) == len(stock_history) == 2 and set(history[0]) == {*stock_history[0], "colo/skipped_steps"}
    assert [h["colo/skipped_steps"] for h in history] == [0, 0]
    # One copy: every parameter (vision tower, projector, language model) is a view of the engine's, and
    # no sync copied a byte or went through vLLM's loader (where torch.distributed was initialized before,
    # here by the stock run, the first sync puts the parameters accelerate moved back in place: reshared_bytes).
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.colo_shared.aliased_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    reports = trainer.vllm_generation.colo_sync_reports
    assert len(reports) == 2 and all(r["bytes_copied"] == 0 for r in reports) and reports[1]["reshared_bytes"] == 0
    assert trainer.colo_test_loads == []
    # The engine generated from the prompt the trainer trains on, under the weights step 1 published.
    # (stock TRL's engine expands the images of its token prompts again: 0.14 and 0.05 measured on the
    # tiny Qwen2.5-VL, shown here, not asserted)
    print(f"{family}: sampling_logp_difference/max stock TRL",
          [h["sampling/sampling_logp_difference/max"] for h in stock_history],
          "colo.trl", [h["sampling/sampling_logp_difference/max"] for h in history])
    assert max(h["sampling/sampling_logp_difference/max"] for h in history) < 1e-4
    assert all(any(part in name for name in changed) for part in TOWER_AND_PROJECTOR[family])


def test_an_engine_prompt_other_than_the_trainers_is_refused():
    from colo.trl_vision import EnginePrompts

    prompts = EnginePrompts()
    prompts.add([[1, 9, 9, 9, 2]], [[1, 9, 2]])
    assert prompts.for_engine([1, 9, 9, 9, 2]) == [1, 9, 2]
    assert prompts.for_engine([1, 9, 9, 9, 2, 7, 8]) == [1, 9, 2, 7, 8]   # a later turn of the tool loop
    assert prompts.for_engine([5, 6]) == [5, 6]
    EnginePrompts.check([[1, 9, 9, 2]], [[1, 9, 9, 2]], [["image"]])
    EnginePrompts.check([[1, 9, 2]], [[1, 9, 9, 9, 2]], [None])            # no image: nothing expanded
    with pytest.raises(ValueError, match="prompt 0 .1 image.s..: the engine expanded its images into 5"):
        EnginePrompts.check([[1, 9, 9, 2]], [[1, 9, 9, 9, 2]], [["image"]])


def peft_trainer(model_dir, tmp_path, target_modules, seen=None):
    """colo.trl with a PEFT LoRA adapter, TRL's default dtype settings (the engine's dtype is what `auto`
    picks on this CPU), on 16 rows of one to four squares."""
    import datasets
    from peft import LoraConfig

    from colo.trl import GRPOTrainer

    def first_token_parity(prompts, completion_ids, image, **kwargs):
        if seen is not None:
            seen.extend(i.tobytes() for i in image)
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]

    rows = [{"prompt": [{"role": "user", "content": "How many squares?"}], "image": squares(i % 4 + 1)}
            for i in range(16)]
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-2,
                          vllm_max_model_length=256, save_strategy="no", use_cpu=True, seed=0,
                          use_vllm=True, vllm_mode="colocate")
    return GRPOTrainer(model=str(model_dir), reward_funcs=first_token_parity,
                       train_dataset=datasets.Dataset.from_list(rows), args=args,
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))


@pytest.mark.usefixtures("stock_trl_in_this_process")
def test_a_peft_adapter_on_a_vision_language_models_language_model_is_the_engines_slot(tiny_vision_dir, tmp_path):
    from safetensors.torch import load_file

    seen = []
    trainer = peft_trainer(tiny_vision_dir("qwen2_5_vl"), tmp_path, ["q_proj", "v_proj"], seen)
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapted = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    # (Qwen2.5-VL's tower has fused qkv layers: q_proj and v_proj are the language model's)
    assert adapted and all(".language_model." in n and ".lora_" in n for n in adapted)
    trainer.train()

    assert len(seen) == 8 and len(set(seen)) > 1
    reports = trainer.vllm_generation.colo_sync_reports
    assert len(reports) == 2 and all(r["bytes_copied"] == 0 and r["adapter_bytes"] > 0 for r in reports)
    changed = [n for n, p in model.named_parameters() if n in adapted and not torch.equal(adapted[n], p)]
    assert any("lora_B" in n for n in changed)
    # The engine samples with the adapter TRL trains (step 2: after step 1's update), within bf16's
    # rounding where either side computes in bf16 (TRL's default bf16=True autocasts the trainer even
    # beside an fp32 engine; 0.0029 measured on an AVX2 EPYC), else fp32's (2e-6).
    history = [h for h in trainer.state.log_history if "reward" in h]
    bf16 = trainer.args.bf16 or trainer.vllm_generation.colo_engine_dtype == torch.bfloat16
    assert max(h["sampling/sampling_logp_difference/max"] for h in history) < (0.02 if bf16 else 1e-4)
    # The saved adapter is PEFT's (its B in PEFT's units, not the slot's alpha/r x B).
    trainer.save_model(str(tmp_path / "adapter"))
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    name = next(n for n in changed if "lora_B" in n)
    key = next(k for k in saved if k.endswith(name.removeprefix("base_model.model.").replace(".default", "")))
    masters = trainer.vllm_generation.colo_masters
    parameter = dict(model.named_parameters())[name]
    assert torch.allclose(saved[key].float(), masters[parameter], atol=1e-6)


@pytest.mark.usefixtures("stock_trl_in_this_process")
def test_a_peft_adapter_on_a_vision_tower_is_refused_before_the_engine_with_a_target_that_works(idefics3_dir,
                                                                                               tmp_path):
    # PEFT's plain target_modules=["q_proj"] also adapts SigLIP's q_proj; vLLM has no slot there.
    with pytest.raises(NotImplementedError, match=r"vision tower or projector .model\.vision_model\.encoder") as e:
        peft_trainer(idefics3_dir, tmp_path, ["q_proj"])
    suggested = re.search(r'target_modules=r"(.+?)"', str(e.value)).group(1)
    trainer = peft_trainer(idefics3_dir, tmp_path, suggested)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.vllm_generation.colo_views.layers
    assert all(".text_model." in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.usefixtures("stock_trl_in_this_process")
def test_colo_trl_trains_gemma3_with_the_image_attention_its_engine_samples_with(tiny_vision_dir, tmp_path):
    """Gemma 3 attends both ways among an image's tokens in transformers; vLLM's CPU backend attends
    causally: the trainer's forwards attend as the engine does. In fp32, where the two attention patterns
    are told apart (the tiny model: 6e-5 to 8e-5 measured without it, 2e-6 with; bf16 rounds at 1e-3)."""
    import datasets

    from colo.trl import GRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": "How many squares?"}], "image": squares(i % 4 + 1)}
            for i in range(16)]
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", learning_rate=1e-2,
                          vllm_max_model_length=512, save_strategy="no", use_cpu=True, seed=0, bf16=False,
                          use_vllm=True, vllm_mode="colocate")
    trainer = GRPOTrainer(model=str(tiny_vision_dir("gemma3")), train_dataset=datasets.Dataset.from_list(rows),
                          reward_funcs=lambda completion_ids, **kw: [float(ids[0] % 2) if ids else 0.0
                                                                     for ids in completion_ids], args=args)
    assert trainer.colo_causal_images
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == 2 and max(h["sampling/sampling_logp_difference/max"] for h in history) < 1e-5
    assert all(r["bytes_copied"] == 0 for r in trainer.vllm_generation.colo_sync_reports)


@pytest.mark.parametrize("trainer_name", ["RLOOTrainer", "DistillationTrainer"])
def test_the_text_only_trainers_refuse_a_vision_language_model_before_an_engine_starts(trainer_name, idefics3_dir,
                                                                                      tmp_path):
    import datasets

    import colo.trl

    rows = [{"prompt": [{"role": "user", "content": "How many squares?"}], "image": squares(1)}] * 4
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=8, max_steps=1,
                    report_to="none", use_cpu=True, use_vllm=True, vllm_mode="colocate")
    if trainer_name == "RLOOTrainer":
        inputs = dict(reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                      args=trl.RLOOConfig(num_generations=4, **settings))
    else:
        inputs = dict(teacher_model=str(idefics3_dir), args=trl.DistillationConfig(**settings))
    with pytest.raises(NotImplementedError, match=rf"colo.trl.{trainer_name} trains text models; a vision-language "
                                                  r"model trains with colo.trl.GRPOTrainer"):
        getattr(colo.trl, trainer_name)(model=str(idefics3_dir), train_dataset=datasets.Dataset.from_list(rows),
                                        **inputs)
