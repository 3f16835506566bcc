"""A colo.trl trainer given `peft_config=LoraConfig(...)`, trained and checked as test_trl_lora.py checks
GRPOTrainer's: the base frozen and shared, the adapter in the engine's LoRA slot."""
import torch

from colo.vllm_compat import engine_model, engine_worker
from conftest import PROMPTS
from helpers.logprobs import trainer_logprobs
from helpers.spies import count_calls

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, task_type="CAUSAL_LM")


def assert_trains_the_engines_adapter_slot(trainer, prompt_logprobs) -> None:
    """Train; the trainable parameters are the engine's adapter slot, the syncs copied nothing, nothing
    was loaded, the base did not move, and the engine serves base + the trained adapter."""
    import colo

    generation = trainer.vllm_generation
    llm = generation.llm
    model = trainer.accelerator.unwrap_model(trainer.model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in generation.colo_views.parameters()}
    assert trainable and all(colo.engine.weights_region(llm).contains(p) for p in trainable)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    loads = count_calls(engine_model(llm), "load_weights")
    adapter_loads = count_calls(engine_worker(llm).model_runner.lora_manager, "_load_adapter")
    trainer.train()

    assert loads == [] and adapter_loads == [], "a sync went through load_weights or reloaded the adapter"
    reports = generation.colo_sync_reports
    assert len(reports) >= 2 and all(r["bytes_copied"] == 0 and r["reshared_bytes"] == 0 for r in reports)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name]), name
    tolerance = 1e-4 if trainable[0].dtype == torch.float32 else 5e-2  # as test_trl_lora.py
    generation.sync_weights()
    served = prompt_logprobs(llm)
    torch.testing.assert_close(served, trainer_logprobs(model, PROMPTS), atol=tolerance, rtol=0)
    with model.disable_adapter():
        base_logprobs = trainer_logprobs(model, PROMPTS)
    assert (served - base_logprobs).abs().max() > 10 * tolerance, "the adapter should change outputs"
