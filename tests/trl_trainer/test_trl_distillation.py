"""colo.trl.DistillationTrainer: TRL's on-policy DistillationTrainer (colocate mode) with colo's engine.

The student is test_trl_rloo.py's tiny random Qwen2, the teacher a wider random one of the same
vocabulary. Against stock TRL (vLLM's CPU linears through F.linear on both sides, as in
test_trl_rloo.py, so that both engines sample the same completions from the same weights) the
completions and the first step's loss and gradient must agree; then the same script as typed (TRL's
defaults: an fp32 model, bf16=True), where the engine takes the dtype auto picks.
"""
from __future__ import annotations

import pytest
import torch

from colo.vllm_compat import engine_model
from colo.vllm_compat.forced_kernels import forced_cpu_gemm
from helpers.spies import count_calls
from helpers.stock_trl import stock_trl_environment

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl", reason="colo.trl's tests need the trl extra: pip install -e '.[cpu,test]'")
from colo.bench.trl_colocate import SIZES, build_model_dir, prompts  # noqa: E402 - after the trl check
from test_trl import assert_engine_serves_the_trained_model  # noqa: E402

TEACHER = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    student, teacher = tmp_path_factory.mktemp("student"), tmp_path_factory.mktemp("teacher")
    build_model_dir(student, SIZES["qwen2-trl-0.4M"])
    build_model_dir(teacher, TEACHER)
    return student, teacher


def distillation_config(tmp_path, **overrides):
    # fp32 on both sides unless overridden: the comparison needs the same numbers.
    settings = dict(per_device_train_batch_size=8, max_completion_length=8, max_steps=2, logging_steps=1,
                    report_to="none", learning_rate=1e-3, vllm_max_model_length=64, save_strategy="no",
                    use_cpu=True, bf16=False, seed=0, model_init_kwargs={"dtype": "float32"},
                    use_vllm=True, vllm_mode="colocate", disable_tqdm=True)
    return trl.DistillationConfig(output_dir=str(tmp_path / "out"), **{**settings, **overrides})


def new_trainer(trainer_class, model_dirs, args, **kwargs):
    student, teacher = model_dirs
    return trainer_class(model=str(student), teacher_model=str(teacher), train_dataset=prompts().select(range(32)),
                         args=args, **kwargs)


def trained_history(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h and "entropy" in h]


@pytest.fixture(scope="module")
def stock_history(model_dirs, tmp_path_factory):
    with stock_trl_environment():
        with forced_cpu_gemm("plain"):
            trainer = new_trainer(trl.DistillationTrainer, model_dirs,
                                  distillation_config(tmp_path_factory.mktemp("stock-distillation")))
        trainer.train()
        history = trained_history(trainer)
        del trainer
    return history


def assert_trains_on_the_engines_weights(trainer, model_dirs, dtype: str, tolerance, prompt_logprobs) -> list[dict]:
    """Train; TRL's syncs copied nothing and never called load_weights, and the engine serves what TRL
    trained (test_trl.py's check: the KV cache slept while TRL trained). Returns the logged steps."""
    loads = count_calls(engine_model(trainer.vllm_generation.llm), "load_weights")
    trainer.train()

    assert loads == [], "TRL's sync went through vLLM's load_weights"
    reports = trainer.vllm_generation.colo_sync_reports
    assert len(reports) >= 2 and all(r["bytes_copied"] == 0 for r in reports)
    history = trained_history(trainer)
    assert len(history) == 2 and all(h["colo/skipped_steps"] == 0 for h in history)
    assert_engine_serves_the_trained_model(trainer, model_dirs[0], dtype, tolerance, prompt_logprobs)
    return history


def test_distillation_trains_on_the_engines_weights_as_stock_trl_does(model_dirs, tmp_path, stock_history,
                                                                      prompt_logprobs):
    from colo.trl import DistillationTrainer

    with forced_cpu_gemm("plain"):
        trainer = new_trainer(DistillationTrainer, model_dirs, distillation_config(tmp_path))
    assert trainer.teacher_model is not None
    history = assert_trains_on_the_engines_weights(trainer, model_dirs, "float32", 1e-4, prompt_logprobs)

    assert len(stock_history) == 2
    assert set(stock_history[0]) <= set(history[0])  # every metric TRL logs, and colo/skipped_steps
    # The same weights and seed, the same completions: the same lengths, and at step 1 (before either
    # side's weights moved) the same divergence from the teacher, gradient and entropy.
    for key in ("completions/mean_length", "completions/min_length", "completions/clipped_ratio"):
        assert history[0][key] == stock_history[0][key], key
    assert history[0]["loss"] == pytest.approx(stock_history[0]["loss"], rel=1e-4)
    assert history[0]["grad_norm"] == pytest.approx(stock_history[0]["grad_norm"], rel=1e-3)
    assert history[0]["entropy"] == pytest.approx(stock_history[0]["entropy"], rel=1e-4)
    # One update later: TRL's optimizer stepped colo's views of the engine's weights as it steps its own.
    assert history[1]["loss"] == pytest.approx(stock_history[1]["loss"], rel=1e-3)


def test_distillation_as_typed_trains_in_the_dtype_auto_picks(model_dirs, tmp_path, prompt_logprobs):
    from colo.dtype_choice import fastest_dtype
    from colo.trl import DistillationTrainer

    # TRL's defaults: an fp32 model, bf16=True.
    args = distillation_config(tmp_path, bf16=True, model_init_kwargs=None)
    trainer = new_trainer(DistillationTrainer, model_dirs, args)
    assert args.use_vllm and trainer.args.use_vllm and trainer.args is not args  # the user's config as it was
    picked = fastest_dtype(trainer.accelerator.device).dtype
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert {p.dtype for p in model.parameters()} == {picked}
    assert bool(trainer.vllm_generation.colo_masters) == (picked == torch.bfloat16)
    history = assert_trains_on_the_engines_weights(trainer, model_dirs, str(picked).removeprefix("torch."),
                                                   1e-4 if picked == torch.float32 else 5e-2, prompt_logprobs)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


def test_distillation_with_a_peft_lora_config_trains_the_engines_adapter_slot(model_dirs, tmp_path, prompt_logprobs):
    pytest.importorskip("peft", reason="colo.trl's LoRA tests need PEFT: pip install -e '.[cpu,test]'")
    from colo.trl import DistillationTrainer
    from helpers.peft_runs import assert_trains_the_engines_adapter_slot, lora_config

    # As typed (bf16=True, the dtype auto picks), a learning rate that moves the adapter in two steps.
    args = distillation_config(tmp_path, bf16=True, model_init_kwargs=None, learning_rate=2e-2)
    trainer = new_trainer(DistillationTrainer, model_dirs, args, peft_config=lora_config())
    assert_trains_the_engines_adapter_slot(trainer, prompt_logprobs)


def test_distillation_refuses_what_it_does_not_run(model_dirs, tmp_path):
    from colo.trl import DistillationTrainer

    with pytest.raises(ValueError, match=r"DistillationTrainer is TRL's colocate mode: pass "
                                         r"args=trl.DistillationConfig\(use_vllm=True"):
        new_trainer(DistillationTrainer, model_dirs, distillation_config(tmp_path, use_vllm=False))
