"""colo.trl: TRL's GRPOTrainer (colocate mode) with colo's engine, on every CPU GEMM kernel vLLM may pick.

A tiny Qwen2 and a byte-level BPE tokenizer are built here (no hub access). After a few TRL GRPO
steps the engine serves exactly the trained model (its log-probabilities against the trainer's own
forward pass), no weight went through vLLM's load_weights after start, and every sync copied 0 bytes.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from colo.vllm_compat import engine_model, kv_cache_block_count
from colo.vllm_compat.forced_kernels import forced_cpu_gemm, sgl_unavailable_reason
from conftest import PROMPTS
from helpers.cpu_gemm import forced_kernel_outcome
from helpers.logprobs import trainer_logprobs
from helpers.spies import count_calls

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl", reason="colo.trl's tests need the trl extra: pip install -e '.[cpu,test]'")
from colo.bench.trl_colocate import SIZES, build_model_dir, even_digits, prompts  # noqa: E402 - after the trl check


@pytest.fixture(scope="module")
def trl_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl-model")
    build_model_dir(path, SIZES["qwen2-trl-0.4M"])  # the bench's: a random Qwen2 and a BPE tokenizer built here
    return path


def trl_config(tmp_path, dtype: str, **overrides):
    prompts = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=3,
                   logging_steps=1, report_to="none", learning_rate=1e-3, vllm_max_model_length=64,
                   save_strategy="no", use_cpu=True, bf16=False, seed=0, model_init_kwargs={"dtype": dtype},
                   use_vllm=True, vllm_mode="colocate")
    return trl.GRPOConfig(output_dir=str(tmp_path / "out"), **{**prompts, **overrides})


def dataset():
    return prompts().select(range(64))


@pytest.mark.cpu_kind
@pytest.mark.parametrize("kernel,dtype", [("sgl", "bfloat16"), ("onednn", "float32"), ("onednn", "bfloat16"),
                                          ("plain", "float32")])
def test_trl_grpo_trains_with_the_engine_sharing_its_weights(kernel, dtype, tmp_path, trl_model_dir, prompt_logprobs):
    from colo.engine import cpu_kernels
    from colo.trl import GRPOTrainer

    if kernel == "sgl" and sgl_unavailable_reason():
        pytest.skip(sgl_unavailable_reason())
    with forced_cpu_gemm(kernel):
        trainer = GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                              args=trl_config(tmp_path, dtype))
    llm = trainer.vllm_generation.llm
    used = forced_kernel_outcome(kernel, getattr(torch, dtype))  # what this vLLM build does when forced
    assert set(cpu_kernels(llm)) == {used}
    # The whole generation batch at full length fits beside vLLM's null block: nothing is preempted.
    blocks, tokens_per_block = kv_cache_block_count(llm)
    max_model_len = llm.llm_engine.model_config.max_model_len
    assert blocks - 1 >= trainer.vllm_generation.max_num_seqs * -(-max_model_len // tokens_per_block)
    loads = count_calls(engine_model(llm), "load_weights")
    trainer.train()

    assert loads == [], "TRL's sync went through vLLM's load_weights"
    reports = trainer.vllm_generation.colo_sync_reports
    # The sgl kernel keeps biases in fp32, so a bf16 trainer's biases are the one thing copied (cast).
    biases = {n: p for n, p in trainer.model.named_parameters() if n.endswith("bias")}
    copied = sum(p.numel() * 4 for p in biases.values()) if used == "sgl" else 0
    assert len(reports) >= 2 and all(r["bytes_copied"] == copied for r in reports)
    weights = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters()
                  if used != "sgl" or n not in biases)
    assert trainer.colo_shared.aliased_bytes == weights
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == 3
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    assert max(h["sampling/sampling_logp_difference/max"] for h in history) < tolerance

    # Where torch.distributed is already initialized in this process (an earlier engine's), accelerate
    # moves the model to "cpu:0" and the first sync shares it again; never a later one.
    assert all(r["reshared_bytes"] == 0 for r in reports[1:])
    assert_engine_serves_the_trained_model(trainer, trl_model_dir, dtype, tolerance, prompt_logprobs)


def assert_engine_serves_the_trained_model(trainer, model_dir, dtype, tolerance, prompt_logprobs):
    """The engine's log-probabilities against the trainer's own forward pass, after a sync as TRL
    does before each generation; and the model did train."""
    from colo.engine import kv_cache_region

    llm = trainer.vllm_generation.llm
    trainer.vllm_generation.sync_weights()
    assert kv_cache_region(llm).asleep  # TRL trained last
    served = prompt_logprobs(llm)  # a direct llm.generate, as with stock TRL: the KV cache wakes for it
    assert not kv_cache_region(llm).asleep
    model = trainer.accelerator.unwrap_model(trainer.model)
    torch.testing.assert_close(served, trainer_logprobs(model, PROMPTS), atol=tolerance, rtol=0)
    initial = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).named_parameters())
    assert any(not torch.equal(initial[n], p) for n, p in model.named_parameters()), "nothing was trained"


def test_a_model_given_new_storage_is_shared_again_at_the_next_sync(tmp_path, trl_model_dir, prompt_logprobs):
    """accelerate's prepare() moves the model with .to(accelerator.device); under torch.distributed on
    a CPU that device is "cpu:0", and torch copies every parameter for it. The next sync shares the
    copies again (one copy, reported), and the syncs after it copy nothing."""
    from colo.trl import GRPOTrainer

    trainer = GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                          args=trl_config(tmp_path, "float32", max_steps=2))
    shared_at_start = trainer.colo_shared
    trainer.model.to("cpu:0")
    assert shared_at_start.moved_parameters(), "torch no longer copies for .to('cpu:0'): this test needs another move"
    trainer.train()

    reports = trainer.vllm_generation.colo_sync_reports
    assert reports[0]["reshared_bytes"] == trainer.colo_shared.aliased_bytes > 0
    assert all(r["reshared_bytes"] == 0 and r["bytes_copied"] == 0 for r in reports[1:]) and len(reports) == 2
    assert trainer.colo_shared.moved_parameters() == [] and trainer.colo_shared is shared_at_start
    assert_engine_serves_the_trained_model(trainer, trl_model_dir, "float32", 1e-4, prompt_logprobs)


def test_trls_importance_sampling_ratio_comes_from_the_training_forward_without_its_own_pass(tmp_path, trl_model_dir):
    """TRL runs a no-grad log-probability pass over each generation for its vLLM importance-sampling
    ratio; where its steps are aligned colo.trl takes the ratio from the training forward instead.
    Against TRL's own pass on the same rows and weights, in TRL's default mode and a token mode: the
    same ratio, loss and `sampling/*` metrics. The engine's log-probabilities reach TRL shifted by a
    seeded noise, so that ratios spread and clip bounds act. fp32 is the subject: the two forwards
    agree to ~1e-7 there, so what is compared is TRL's formula."""
    from colo.trl import GRPOTrainer
    from colo.trl_importance import DEFERRED_KEYS, steps_are_aligned

    trainer = GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                          args=trl_config(tmp_path, "float32", max_steps=1))
    assert trainer.vllm_importance_sampling_correction and steps_are_aligned(trainer.args, trainer.num_iterations)
    assert not steps_are_aligned(trainer.args, 2)  # num_iterations=2: TRL's pass runs, as TRL wrote it
    no_grad_passes = []
    real_pass, real_generate = trainer._get_per_token_logps_and_entropies, trainer.vllm_generation.generate
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (  # spies, for this test
        no_grad_passes.append(1) if not torch.is_grad_enabled() else None) or real_pass(*a, **k)
    noise = torch.Generator().manual_seed(0)

    def generate_with_shifted_logprobs(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = real_generate(*args, **kwargs)
        shifted = [[[lp[0] + 0.6 * torch.randn((), generator=noise).item(), *lp[1:]] for lp in seq] for seq in logprobs]
        return prompt_ids, completion_ids, shifted, token_ids

    trainer.vllm_generation.generate = generate_with_shifted_logprobs
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what the Trainer's loop sets
    rows = [dataset()[i // 4] for i in range(8)]     # 2 prompts x num_generations
    assert not set(DEFERRED_KEYS) & set(trainer._generate_and_score_completions(rows)) and no_grad_passes == []
    metrics = trainer._metrics["train"]
    assert not [n for n in metrics if n.startswith("sampling/")]  # given once its micro-batches have trained

    # TRL's default mode (a row past the bound: 0), then a token mode (a token past it: the bound)
    for mode, bound in [("sequence_mask", 0.0), ("token_truncate", trainer.vllm_importance_sampling_clip_max)]:
        trainer.vllm_importance_sampling_mode = mode
        trainer.colo_one_logprob_pass = False
        theirs = trainer._generate_and_score_completions(rows)  # TRL's pass, its ratio and metrics
        trainer.colo_one_logprob_pass = True
        assert set(DEFERRED_KEYS) <= set(theirs) and len(no_grad_passes) == 1
        no_grad_passes.clear()
        names = [n for n in metrics if n.startswith("sampling/")]
        trl_metrics = {n: metrics[n][-1] for n in names}
        ours = {key: value for key, value in theirs.items() if key not in DEFERRED_KEYS}
        loss_ours = trainer.compute_loss(trainer.model, ours)
        loss_theirs = trainer.compute_loss(trainer.model, theirs)

        ratio = theirs["importance_sampling_ratio"]
        kept = ratio[ratio > 0]
        assert kept.std() > 0.1 and (ratio == bound).any(), "the noise no longer spreads the ratios to the clip bound"
        torch.testing.assert_close(ours["importance_sampling_ratio"], ratio, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss_ours, loss_theirs, atol=1e-6, rtol=1e-5)
        trainer._colo_log_sampling_metrics()
        assert len(names) == 5 and trl_metrics["sampling/sampling_logp_difference/mean"] > 0.1
        for name in names:
            assert metrics[name][-1] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), (mode, name)


def test_unsupported_setups_are_refused_with_what_is_supported(tmp_path, trl_model_dir, monkeypatch):
    from colo.trl import GRPOTrainer

    with pytest.raises(ValueError, match="use_vllm=True"):
        GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                    args=trl_config(tmp_path, "float32", use_vllm=False))
    with pytest.raises(ValueError, match="vllm_mode='colocate'"):
        GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                    args=trl_config(tmp_path, "float32", vllm_mode="server"))
    with pytest.raises(NotImplementedError, match="vllm_enable_sleep_mode=False"):
        GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                    args=trl_config(tmp_path, "float32", vllm_enable_sleep_mode=True))
    from trl.distributed import DistributedBackend

    monkeypatch.setattr(DistributedBackend, "is_zero3", property(lambda self: True))
    with pytest.raises(NotImplementedError, match="ZeRO-3 and FSDP"):
        GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                    args=trl_config(tmp_path, "float32"))


@pytest.mark.cpu_kind
def test_an_fp32_model_trains_with_a_bf16_engine_and_fp32_masters_in_trls_optimizer(tmp_path, trl_model_dir,
                                                                                     prompt_logprobs):
    """TRL's default fp32 model with a bf16 engine (what `auto` picks where bf16 is fast; asked for
    here, so every CPU kind runs it): the parameters are the engine's bf16 tensors, TRL's own
    optimizer steps the model's fp32 values and rounds them into those tensors, and save_model and
    checkpoints keep the fp32 values."""
    from safetensors.torch import load_file

    from colo.optimizer_masters import MASTERS_KEY
    from colo.trl import GRPOTrainer

    initial = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(trl_model_dir).named_parameters()}
    trainer = GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                          args=trl_config(tmp_path, "auto", max_steps=2, save_strategy="steps", save_steps=2),
                          colo_engine_dtype="bfloat16")
    assert "fp32 masters" in trainer.colo_engine_dtype_reason
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert trainer.colo_shared.aliased_bytes == sum(p.nbytes for p in model.parameters())
    masters = trainer.vllm_generation.colo_masters
    for name, p in model.named_parameters():  # the masters are the model's fp32 values as loaded
        assert torch.equal(masters[p], initial[name])
    trainer.train()

    assert all(r["bytes_copied"] == 0 for r in trainer.vllm_generation.colo_sync_reports)
    stepped = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in stepped} == {torch.float32} and len(stepped) == len(masters)
    trained = {n: masters[p] for n, p in model.named_parameters()}
    assert any(not torch.equal(trained[n], initial[n]) for n in initial), "nothing was trained"
    for name, p in model.named_parameters():  # the shared bf16 weights are the masters, rounded
        assert torch.equal(p.detach(), trained[name].bfloat16()), name
    # Some updates are smaller than bf16's spacing at the weight: the masters keep them.
    assert any(((initial[n] != trained[n]) & (initial[n].bfloat16() == trained[n].bfloat16())).any() for n in initial)
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert max(h["sampling/sampling_logp_difference/max"] for h in history) < 5e-2
    assert [h["colo/skipped_steps"] for h in history] == [0, 0]
    assert_engine_serves_the_trained_model(trainer, trl_model_dir, "float32", 5e-2, prompt_logprobs)

    # The checkpoint TRL wrote at step 2 holds the fp32 values, in the model and the optimizer state.
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = load_file(checkpoint / "model.safetensors")
    assert all(saved[n].dtype == torch.float32 and torch.equal(saved[n], trained[n]) for n in saved)
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(state[MASTERS_KEY]) == len(masters)
    trainer.save_model(str(tmp_path / "final"))
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(final[n], trained[n]) for n in final)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")  # in the dtype config.json names
    assert all(p.dtype == torch.float32 and torch.equal(p, trained[n]) for n, p in reloaded.named_parameters())

    # Resuming from that checkpoint: the model's fp32 values are read into the shared bf16 weights
    # (rounded), then the optimizer state's masters replace the masters; training goes on from them.
    del trainer, model, masters
    resumed = GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(),
                          args=trl_config(tmp_path, "auto", max_steps=3), colo_engine_dtype="bfloat16")
    at_start = []

    class Inspect(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            again, m = resumed.vllm_generation.colo_masters, resumed.accelerator.unwrap_model(resumed.model)
            at_start.append(all(torch.equal(again[p], trained[n]) and torch.equal(p.detach(), trained[n].bfloat16())
                                for n, p in m.named_parameters()))

    class Poison(transformers.TrainerCallback):  # an inf in one gradient, after TRL's clip, before its step
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            next(resumed.accelerator.unwrap_model(resumed.model).parameters()).grad.view(-1)[0] = float("inf")

    resumed.add_callback(Inspect())
    resumed.add_callback(Poison())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert at_start == [True], "the resumed model is not the checkpoint's fp32 values"
    assert resumed.state.global_step == 3
    assert [h["step"] for h in resumed.state.log_history if "reward" in h] == [1, 2, 3]
    # Step 3's gradient held an inf: TRL's optimizer skipped it; the masters and the weights the engine
    # serves are still the checkpoint's.
    assert resumed.colo_step_guard.skipped_steps == 1 and resumed.colo_fp32_masters.skipped_steps == 1
    again, m = resumed.vllm_generation.colo_masters, resumed.accelerator.unwrap_model(resumed.model)
    assert all(torch.equal(again[p], trained[n]) and torch.equal(p.detach(), trained[n].bfloat16())
               for n, p in m.named_parameters())


def test_the_engine_dtype_follows_the_device_and_the_users_explicit_choices(monkeypatch, trl_model_dir, tmp_path):
    from colo import trl as colo_trl
    from colo.dtype_choice import DtypeChoice

    fp32_model = AutoModelForCausalLM.from_pretrained(trl_model_dir)

    def choice(device_dtype, **config):
        monkeypatch.setattr("colo.dtype_choice.fastest_dtype", lambda device: DtypeChoice(device_dtype, "measured"))
        args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **config)
        return colo_trl.choose_engine_dtype(fp32_model, args)[:2]

    assert choice(torch.bfloat16) == (torch.bfloat16, True)   # TRL's defaults: fp32 model, bf16=True
    assert choice(torch.float32) == (torch.float32, False)    # an AVX2 CPU: fp32 one copy
    assert choice(torch.bfloat16, bf16=False) == (torch.float32, False)
    assert choice(torch.bfloat16, model_init_kwargs={"dtype": "float32"}) == (torch.float32, False)
    assert choice(torch.bfloat16, model_init_kwargs={"dtype": "auto"}) == (torch.bfloat16, True)
    assert choice(torch.bfloat16, cast_lm_head_to_fp32=True) == (torch.float32, False)
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert colo_trl.choose_engine_dtype(fp32_model, args, "float32")[:2] == (torch.float32, False)
    assert colo_trl.choose_engine_dtype(fp32_model, args, "bf16")[:2] == (torch.bfloat16, True)
    with pytest.raises(ValueError, match="colo_engine_dtype must be one of"):
        colo_trl.choose_engine_dtype(fp32_model, args, "int8")
    assert colo_trl.choose_engine_dtype(fp32_model.bfloat16(), args)[:2] == (torch.bfloat16, False)  # in place: last


def test_trls_private_methods_colo_overrides_are_listed_and_checked_at_import(monkeypatch):
    from colo import trl as colo_trl

    classes = (colo_trl.ColoVLLMGeneration, colo_trl.GRPOTrainer, colo_trl.RLOOTrainer, colo_trl.DistillationTrainer)
    overridden = {name for cls in classes for name in colo_trl.trl_private_overrides(cls)}
    assert overridden == set(colo_trl.TRL_PRIVATE_OVERRIDES)  # each listed once, with its reason
    # A release that renamed one: refused, naming it (colo's override would silently not run).
    renamed = type("Renamed", (trl.RLOOTrainer,), {"__module__": colo_trl.__name__, "_score_completions": None})
    with pytest.raises(ImportError, match=r"overrides RLOOTrainer._score_completions, which TRL"):
        colo_trl.check_trl_surface((renamed,))
    # An untested release that still has them all: a warning naming what to check, no error.
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.warns(UserWarning, match=r"tested with TRL 1.16.0, found 1.17.0. Its overrides of TRL's _generate"):
        colo_trl.check_trl_surface(classes)


def test_a_moe_model_trains_with_routing_replay_and_one_copy(tmp_path, trl_model_dir):
    """colo_routing_replay on a Qwen3-MoE: TRL's log-probability passes (the old policy's, with
    num_iterations=2, and the loss's forward and backward) route every token to the engine's experts;
    the syncs copy 0 bytes; a dense model and gradient checkpointing are refused before any engine."""
    from colo.bench.trl_colocate import build_model_dir
    from colo.trl import GRPOTrainer

    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    build_model_dir(moe_dir, dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1), arch="qwen3_moe")
    args = trl_config(tmp_path, "float32", max_steps=2, gradient_checkpointing=False, num_iterations=2)
    trainer = GRPOTrainer(model=str(moe_dir), reward_funcs=even_digits, train_dataset=dataset(), args=args,
                          colo_routing_replay=True, colo_engine_options={"enforce_eager": True})
    trainer.train()
    replay = trainer.colo_router_replay
    # one generation of 8 rows (num_iterations=2 over 2 steps): the old policy's pass and the loss's pass at
    # each step, 2 MoE layers, every row at least its 6 prompt words and one completion token
    assert replay.forced >= 2 * 3 * 8 * (6 + 1)
    assert all(r["bytes_copied"] == 0 for r in trainer.vllm_generation.colo_sync_reports)
    assert any("colo/router_mismatch" in h for h in trainer.state.log_history)
    with pytest.raises(ValueError, match="no MoE layers"):
        GRPOTrainer(model=str(trl_model_dir), reward_funcs=even_digits, train_dataset=dataset(), args=args,
                    colo_routing_replay=True)
    with pytest.raises(NotImplementedError, match="gradient_checkpointing"):
        GRPOTrainer(model=str(moe_dir), reward_funcs=even_digits, train_dataset=dataset(),
                    args=trl_config(tmp_path, "float32", gradient_checkpointing=True), colo_routing_replay=True)
