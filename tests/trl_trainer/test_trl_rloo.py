"""colo.trl.RLOOTrainer: TRL's RLOOTrainer (colocate mode) with colo's engine, against stock TRL.

The same tiny random Qwen2, prompts and reward as test_trl.py. Stock TRL runs with vLLM's CPU linears
through F.linear (its weight sync crashes on vLLM's packed ones), and so does colo's side here, so that
both engines sample the same completions from the same weights: the rewards and the first step's
gradient must then agree, while colo's syncs copy nothing and the engine serves the trained model.
"""
from __future__ import annotations

import pytest
import torch

from colo.vllm_compat import engine_model
from colo.vllm_compat.forced_kernels import forced_cpu_gemm
from conftest import PROMPTS
from helpers.logprobs import trainer_logprobs
from helpers.spies import count_calls
from helpers.stock_trl import stock_trl_environment

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl", reason="colo.trl's tests need the trl extra: pip install -e '.[cpu,test]'")
from colo.bench.trl_colocate import SIZES, build_model_dir, even_digits, prompts  # noqa: E402 - after the trl check


@pytest.fixture(scope="module")
def rloo_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rloo-model")
    build_model_dir(path, SIZES["qwen2-trl-0.4M"])
    return path


def rloo_config(tmp_path, **overrides):
    # fp32 on both sides: the comparison needs the same numbers, and an explicit dtype keeps colo's
    # engine in it (by default an fp32 model gets a bf16 engine on a bf16 device: test_trl.py's subject).
    settings = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
                    logging_steps=1, report_to="none", learning_rate=1e-3, vllm_max_model_length=64,
                    save_strategy="no", use_cpu=True, bf16=False, seed=0, model_init_kwargs={"dtype": "float32"},
                    use_vllm=True, vllm_mode="colocate", disable_tqdm=True)
    return trl.RLOOConfig(output_dir=str(tmp_path / "out"), **{**settings, **overrides})


@pytest.fixture(scope="module")
def stock_history(rloo_model_dir, tmp_path_factory):
    with stock_trl_environment():
        with forced_cpu_gemm("plain"):
            trainer = trl.RLOOTrainer(model=str(rloo_model_dir), reward_funcs=even_digits,
                                      train_dataset=prompts().select(range(64)),
                                      args=rloo_config(tmp_path_factory.mktemp("stock-rloo")))
        trainer.train()
        history = [h for h in trainer.state.log_history if "reward" in h]
        del trainer
    return history


def test_rloo_trains_on_the_engines_weights_as_stock_trl_does(rloo_model_dir, tmp_path, stock_history,
                                                                  prompt_logprobs):
    from colo.engine import kv_cache_region
    from colo.trl import RLOOTrainer

    with forced_cpu_gemm("plain"):
        trainer = RLOOTrainer(model=str(rloo_model_dir), reward_funcs=even_digits,
                              train_dataset=prompts().select(range(64)), args=rloo_config(tmp_path))
    assert trainer.ref_model is not None  # beta 0.05, TRL's default: its reference model beside the engine
    llm = trainer.vllm_generation.llm
    loads = count_calls(engine_model(llm), "load_weights")
    trainer.train()

    assert loads == [], "TRL's sync went through vLLM's load_weights"
    reports = trainer.vllm_generation.colo_sync_reports
    assert len(reports) >= 2 and all(r["bytes_copied"] == 0 for r in reports)
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == len(stock_history) == 2
    # The same weights and seed, the same completions: the same rewards, and at step 1 (before either
    # side's weights moved) the same gradient.
    assert history[0]["reward"] == pytest.approx(stock_history[0]["reward"], abs=1e-6)
    assert history[0]["reward_std"] == pytest.approx(stock_history[0]["reward_std"], abs=1e-6)
    assert history[0]["grad_norm"] == pytest.approx(stock_history[0]["grad_norm"], rel=1e-3)
    assert history[0]["loss"] == pytest.approx(stock_history[0]["loss"], abs=1e-5)
    assert all(h["colo/skipped_steps"] == 0 for h in history)

    # The engine serves what TRL trained, and the KV cache slept while it trained.
    trainer.vllm_generation.sync_weights()
    assert kv_cache_region(llm).asleep
    model = trainer.accelerator.unwrap_model(trainer.model)
    torch.testing.assert_close(prompt_logprobs(llm), trainer_logprobs(model, PROMPTS), atol=1e-4, rtol=0)


def test_rloo_with_a_peft_lora_config_trains_the_engines_adapter_slot(rloo_model_dir, tmp_path, prompt_logprobs):
    pytest.importorskip("peft", reason="colo.trl's LoRA tests need PEFT: pip install -e '.[cpu,test]'")
    from colo.trl import RLOOTrainer
    from helpers.peft_runs import assert_trains_the_engines_adapter_slot, lora_config

    # As typed (bf16=True, the dtype auto picks; TRL's beta: the reference is the base, adapter disabled).
    args = rloo_config(tmp_path, bf16=True, model_init_kwargs=None, learning_rate=2e-2)
    trainer = RLOOTrainer(model=str(rloo_model_dir), reward_funcs=even_digits, train_dataset=prompts().select(range(64)),
                          args=args, peft_config=lora_config())
    assert_trains_the_engines_adapter_slot(trainer, prompt_logprobs)


def test_rloo_refuses_what_it_does_not_run(rloo_model_dir, tmp_path):
    from colo.trl import RLOOTrainer

    with pytest.raises(ValueError, match=r"RLOOTrainer is TRL's colocate mode: pass args=trl.RLOOConfig"):
        RLOOTrainer(model=str(rloo_model_dir), reward_funcs=even_digits, train_dataset=prompts().select(range(8)),
                    args=rloo_config(tmp_path, use_vllm=False))
