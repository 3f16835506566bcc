"""colo.grpo's loss variants against TRL 1.16's own arithmetic on the same tensors (log-probabilities,
old and reference log-probabilities, advantages, masks): every loss type, token- and sequence-level
ratios (GSPO), two-sided clipping (delta) and the KL's bias correction; values and gradients equal to
float tolerance. TRL's loss sits inside GRPOTrainer._compute_loss (a method needing a whole trainer),
so `trl_loss` below transcribes it: trl/trainer/grpo_trainer.py, from `log_ratio = per_token_logps -
old_per_token_logps` (line 3083) to the `luspo` branch (line 3175), one micro-batch, one process, no
gradient accumulation, no vLLM importance-sampling ratio, no entropy mask."""
import dataclasses
import itertools
import json

import pytest
import torch

from colo.grpo.config import LOSS_TYPES, GRPOConfig
from colo.grpo.loss import grpo_loss, loss_denominators


def trl_loss(per_token_logps, old_per_token_logps, advantages, mask, ref_per_token_logps, *, beta, loss_type,
             importance_sampling_level, delta, use_bias_correction_kl, epsilon_low, epsilon_high,
             sapo_temperature_pos, sapo_temperature_neg, max_completion_length, entropy_mask=None):
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps)
                        - (ref_per_token_logps - per_token_logps) - 1)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    elif loss_type == "vespo":
        phi_seq = trl_gamma_weights(advantages, log_ratio, mask, None, 2.0, 3.0, 3.0, 2.0)
        per_token_loss = -phi_seq * advantages * per_token_logps
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ["grpo", "sapo"]:
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type in ["cispo", "dapo", "vespo"]:
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)   # num_items_in_batch, one process
    if loss_type == "luspo":
        return (per_token_loss * mask).sum(-1).mean()


@torch.no_grad()
def trl_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos, lambda_pos, k_neg,
                      lambda_neg):
    """GRPOTrainer.get_gamma_weights (trl/trainer/grpo_trainer.py, VESPO's weights), transcribed."""
    import math

    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, columns = 4, 6
    old = -torch.rand(rows, columns, generator=g) * 3
    new = old + 0.4 * torch.randn(rows, columns, generator=g)   # ratios well away from 1: clipping happens
    ref = old + 0.2 * torch.randn(rows, columns, generator=g)
    mask = torch.ones(rows, columns)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return new, old, ref, torch.tensor([1.3, -0.7, 0.2, -1.1]), mask


SETTINGS = list(itertools.product(LOSS_TYPES, ("token", "sequence"), (None, 1.5), (True, False)))


def test_every_trl_loss_type_is_here():
    assert set(LOSS_TYPES) >= {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"}


@pytest.mark.parametrize("loss_type,level,delta,bias_kl", SETTINGS)
def test_the_loss_and_its_gradient_are_trls(loss_type, level, delta, bias_kl):
    new, old, ref, advantages, mask = tensors(seed=hash((loss_type, level, delta, bias_kl)) % 1000)
    epsilon_high = 5.0 if loss_type == "cispo" else 0.28   # CISPO's cap is a ratio, not a clip range
    settings = dict(beta=0.04, epsilon_low=0.2, epsilon_high=epsilon_high, delta=delta)
    theirs_in = new.clone().requires_grad_(True)
    theirs = trl_loss(theirs_in, old, advantages, mask, ref, loss_type=loss_type, importance_sampling_level=level,
                      use_bias_correction_kl=bias_kl, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                      max_completion_length=8, **settings)
    theirs.backward()
    mine_in = new.clone().requires_grad_(True)
    rows = float(mask.shape[0])
    denominators = loss_denominators(loss_type, mask, global_tokens=float(mask.sum()), global_sequences=rows,
                                     max_new_tokens=8)
    mine = grpo_loss(mine_in, old, advantages, mask, ref_logprobs=ref, num_tokens=denominators, loss_type=loss_type,
                     importance_sampling_level=level, bias_correction_kl=bias_kl, **settings).loss
    mine.backward()
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-6)


def test_bad_variant_settings_are_refused():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        GRPOConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level must be 'token' or 'sequence'"):
        GRPOConfig(importance_sampling_level="batch")
    with pytest.raises(ValueError, match="delta .* must exceed 1 \\+ epsilon_high"):
        GRPOConfig(delta=1.1)


def test_num_iterations_steps_the_optimizer_mu_times_clipping_against_the_sampling_weights(tmp_path):
    """TRL's num_iterations: each rollout trains mu optimizer steps; the later ones compare against the
    log-probabilities the first kept (the weights the rollout was sampled with), so at a large learning
    rate their ratios leave the clip range, while the first step's ratios are all 1."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model

    task = ToyTask(512)
    config = GRPOConfig(prompts_per_step=4, num_generations=4, ignore_eos=True, learning_rate=3e-2, save_every=0,
                        num_iterations=3, epsilon_low=0.05, epsilon_high=0.05, log_completions=True,
                        num_completions_to_print=3, report_to=["tensorboard"],
                        multi_objective_aggregation="normalize_then_sum",   # (its path through a step, too)
                        dtype="fp32")  # on every CPU kind, so that the engine's log-probabilities equal to 1e-4
    scheduler = GRPOScheduler(build_toy_model(tmp_path / "model"), task.rewards, task.prompts, config,
                              out_dir=tmp_path / "out", log_path=tmp_path / "log.jsonl")
    try:
        records = scheduler.run(2, progress=False)
        optimizer = getattr(scheduler.optimizer, "optimizer", scheduler.optimizer)
        steps = {int(state["step"]) for state in optimizer.state.values()}
    finally:
        scheduler.close()
    # TRL's log_completions: 3 per step, with each reward and the advantage, in OUT and in TensorBoard.
    logged = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in logged] == [1, 1, 1, 2, 2, 2]
    assert all(isinstance(s["completion"], list) and set(s["rewards"]) == {"rewards"} and s["advantage"] is not None
               for s in logged)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "out" / "runs").iterdir())), size_guidance={"tensors": 0})
    events.Reload()
    assert "completions/text_summary" in events.Tags()["tensors"]
    assert steps == {6}                                   # 2 rollouts x 3 optimizer steps each
    for record in records:
        assert record["optimizer_steps"] == 3 and record["clip_fraction"] == 0.0
        assert record["last_iteration/clip_fraction"] > 0.0
        assert record["publish_bytes_copied"] == 0
    # The engine sampled step 2 from the weights all three of step 1's optimizer steps made.
    assert records[1]["engine_logprob_max_abs_diff"] < 1e-4
    with pytest.raises(ValueError, match="num_iterations=2 with overlap='on'"):
        GRPOConfig(num_iterations=2, overlap="on")


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_the_schedule_is_transformers_after_warmup(kind):
    """After warm-up the multiplier is transformers' get_*_schedule_with_warmup's (TRL's trainers' schedules)."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
    from transformers import get_linear_schedule_with_warmup

    from colo.grpo.schedules import lr_multiplier, warmup_of

    total, warmup = 20, warmup_of(0, 0.1, 20)
    assert warmup == 2
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "constant":
        theirs = get_constant_schedule_with_warmup(optimizer, warmup)
    else:
        make = get_linear_schedule_with_warmup if kind == "linear" else get_cosine_schedule_with_warmup
        theirs = make(optimizer, warmup, total)
    for step in range(total):
        expected = theirs.lr_lambdas[0](step)
        mine = lr_multiplier(step, kind, warmup, total)
        if step < warmup:   # colo's warm-up trains from the first step: (step + 1) / warmup, transformers' step / warmup
            assert mine == pytest.approx((step + 1) / warmup) and expected == pytest.approx(step / warmup)
        else:
            assert mine == pytest.approx(expected, abs=1e-9)
    with pytest.raises(ValueError, match="need max_steps"):
        GRPOConfig(lr_scheduler_type="cosine")
    with pytest.raises(ValueError, match="lr_scheduler_type must be one of"):
        GRPOConfig(lr_scheduler_type="step", max_steps=3)


def test_the_cli_takes_the_optimizer_and_loss_settings(tmp_path):
    from colo.grpo.cli import _settings, build_parser, parse_args

    parser = build_parser()
    args = parse_args(parser, ["--steps", "10", "--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out"),
                               "--lr-scheduler-type", "cosine", "--warmup-ratio", "0.1", "--weight-decay", "0.01",
                               "--adam-betas", "0.9", "0.999", "--adam-epsilon", "1e-6", "--max-grad-norm", "0",
                               "--num-iterations", "2", "--loss-type", "sapo", "--importance-sampling-level",
                               "sequence", "--delta", "1.5", "--no-bias-correction-kl"])
    _, config, _ = _settings(args, parser)
    assert (config.lr_scheduler_type, config.warmup_ratio, config.max_steps) == ("cosine", 0.1, 20)
    assert (config.weight_decay, config.adam_betas, config.adam_epsilon, config.max_grad_norm) == \
        (0.01, (0.9, 0.999), 1e-6, None)
    assert (config.num_iterations, config.loss_type, config.importance_sampling_level, config.delta,
            config.use_bias_correction_kl) == (2, "sapo", "sequence", 1.5, False)


def test_generation_options_reach_vllms_sampling_params():
    from vllm import SamplingParams

    from colo.grpo.task import CallableTask, sampling_options

    config = GRPOConfig(min_p=0.05, repetition_penalty=1.1, generation_kwargs={"presence_penalty": 0.5})
    options = sampling_options(config, CallableTask(lambda s, n: [[1]] * n, lambda p, c: [0.0] * len(c)), 1, range(2))
    params = SamplingParams(**options[0])
    assert (params.min_p, params.repetition_penalty, params.presence_penalty) == (0.05, 1.1, 0.5)
    with pytest.raises(ValueError, match="did you mean 'presence_penalty'"):
        GRPOConfig(generation_kwargs={"presense_penalty": 0.5})
    with pytest.raises(ValueError, match="colo sets seed itself"):
        GRPOConfig(generation_kwargs={"seed": 3})


def test_dynamic_sampling_replaces_groups_that_teach_nothing(tmp_path):
    """DAPO's dynamic sampling: a group whose rewards are all equal is dropped and new prompts' groups
    are generated until the step has as many informative groups as prompts (or the extra generations
    run out); the step trains on those."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model
    from colo.grpo import dynamic_sampling
    from colo.grpo.batch import Rollout
    from colo.grpo.task import Scores

    toy = ToyTask(512)

    def reward(prompts, completions):   # a prompt whose first token is odd scores 0 whatever is sampled
        return [float(p[0] % 2 == 0 and c[0] % 2 == 0) for p, c in zip(prompts, completions)]

    trained_rollouts = []
    config = GRPOConfig(prompts_per_step=4, num_generations=4, ignore_eos=True, learning_rate=3e-3, save_every=0,
                        dynamic_sampling=4)
    scheduler = GRPOScheduler(build_toy_model(tmp_path / "model"), reward, toy.prompts, config)
    backward = scheduler.trainer.backward
    scheduler.trainer.backward = lambda rollout, *a, **k: (trained_rollouts.append(rollout), backward(rollout, *a, **k))[1]
    try:
        records = [scheduler.train_step() for _ in range(3)]
    finally:
        scheduler.close()
    assert sum(r["dynamic_sampling/dropped_groups"] for r in records) > 0
    for record, rollout in zip(records, trained_rollouts):
        generated, trained = record["dynamic_sampling/generated_groups"], record["dynamic_sampling/trained_groups"]
        assert generated == 4 * (1 + record["dynamic_sampling/extra_generations"])
        assert record["dynamic_sampling/dropped_groups"] == generated - trained
        assert len(rollout.rows) == 4 * trained
        rewards = torch.tensor(reward(rollout.prompts, rollout.completions)).view(-1, 4)
        assert all(len(set(group.tolist())) > 1 for group in rewards)   # every trained group teaches something
    # The pieces on their own: all-equal groups out, NaN (unscorable) left out of the comparison.
    scores = Scores(torch.tensor([[1.0], [1.0], [0.0], [1.0], [float("nan")], [2.0]]), torch.ones(1), ("r",))
    assert dynamic_sampling.informative_groups(scores, 2) == [1]
    rollout = Rollout(rows=[0, 0, 1, 1, 2, 2], prompts=[[1]] * 6, completions=[[i] for i in range(6)],
                      logprobs=[None] * 6, truncated=[False] * 6)
    picked, picked_scores = dynamic_sampling.select_groups(rollout, scores, [1], 2)
    assert picked.completions == [[2], [3]] and picked_scores.per_function.flatten().tolist() == [0.0, 1.0]
    assert dynamic_sampling.concatenated([picked, picked]).completions == [[2], [3], [2], [3]]


def test_normalize_then_sum_is_trls_gdpo_aggregation():
    """TRL's multi_objective_aggregation="normalize_then_sum", transcribed from trl/trainer/grpo_trainer.py
    (the `elif self.multi_objective_aggregation == "normalize_then_sum":` branch, line 2790; one process),
    against colo's normalized_sum + batch_advantages, unscorable completions included."""
    from colo.grpo.loss import batch_advantages, nanstd, normalized_sum

    g = torch.Generator().manual_seed(3)
    num_generations, functions = 4, 3
    rewards_per_func = torch.rand(12, functions, generator=g)
    rewards_per_func[5, 1] = float("nan")               # one function could not score one completion
    rewards_per_func[9] = float("nan")                  # no function could score this one
    reward_weights = torch.tensor([1.0, 0.5, 2.0])
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)

    grouped = rewards_per_func.view(-1, num_generations, functions)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, functions)
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards)
    theirs = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4), nan=0.0)

    sums = normalized_sum(rewards_per_func, reward_weights, num_generations)
    scored = sums[~torch.isnan(sums)]
    mine = batch_advantages(sums, float(scored.mean()), float(scored.std()))
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert mine[9] == 0.0
    with pytest.raises(ValueError, match="multi_objective_aggregation must be"):
        GRPOConfig(multi_objective_aggregation="sum")


def test_top_entropy_quantile_keeps_trls_tokens():
    """TRL's top_entropy_quantile: its get_high_entropy_mask (trl/trainer/grpo_trainer.py, one process:
    the gathered entropies are this batch's) against colo's high_entropy_mask; the entropies colo's
    chunked and straightforward log-probability paths give against TRL's entropy_from_logits; and the
    loss with the mask against TRL's (the policy term masked, the KL term not)."""
    from trl.trainer.utils import entropy_from_logits

    from colo.grpo.batch import pack
    from colo.grpo.logprobs import completion_logprobs_chunked, full_logits_logprobs
    from colo.grpo.loss import high_entropy_mask
    from helpers.models import one_layer_qwen2

    def trl_mask(entropies, mask, threshold):
        local = entropies[mask.bool()].float()
        entropy_threshold = torch.quantile(local, threshold)
        masked_entropies = entropies * mask.float()
        return masked_entropies >= entropy_threshold

    model = one_layer_qwen2()
    batch = pack([[1, 2, 3], [4, 5]], [[11, 12, 13, 14], [15, 16]])
    args = (model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids, 0.7)
    chunked, full = [], []
    completion_logprobs_chunked(*args, chunk_tokens=3, entropies=chunked)
    full_logits_logprobs(*args, entropies=full)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, -5:-1].detach() / 0.7
    torch.testing.assert_close(chunked[0], entropy_from_logits(logits), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full[0], chunked[0], rtol=1e-5, atol=1e-5)
    mask = batch.completion_mask
    for quantile in (0.2, 0.5, 0.8):
        mine = high_entropy_mask(chunked[0], mask, quantile)
        assert torch.equal(mine, trl_mask(chunked[0], mask, 1 - quantile) & mask.bool())
    assert 0 < int(high_entropy_mask(chunked[0], mask, 0.5).sum()) < int(mask.sum())

    new, old, ref, advantages, mask = tensors(seed=7)
    entropy_mask = torch.rand(new.shape, generator=torch.Generator().manual_seed(1)) > 0.5
    theirs_in, mine_in = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    common = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, delta=None)
    trl_loss(theirs_in, old, advantages, mask, ref, loss_type="dapo", importance_sampling_level="token",
             use_bias_correction_kl=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
             max_completion_length=8, entropy_mask=entropy_mask, **common).backward()
    grpo_loss(mine_in, old, advantages, mask, ref_logprobs=ref, token_mask=entropy_mask, **common).loss.backward()
    torch.testing.assert_close(mine_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        GRPOConfig(top_entropy_quantile=0.0)


def test_steps_per_generation_slices_a_rollout_over_optimizer_steps(tmp_path):
    """TRL's steps_per_generation: a rollout of 4 prompts' groups trains in 2 slices, an optimizer step
    each (x num_iterations 2: 4 steps per rollout); every step compares against the log-probabilities of
    the weights the rollout was sampled with, so the later ones clip at a large learning rate."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model

    task = ToyTask(512)
    config = GRPOConfig(prompts_per_step=4, num_generations=4, ignore_eos=True, learning_rate=3e-2, save_every=0,
                        steps_per_generation=2, num_iterations=2, epsilon_low=0.05, epsilon_high=0.05,
                        dtype="fp32")  # on every CPU kind, as above
    scheduler = GRPOScheduler(build_toy_model(tmp_path / "model"), task.rewards, task.prompts, config)
    try:
        records = [scheduler.train_step() for _ in range(2)]
        optimizer = getattr(scheduler.optimizer, "optimizer", scheduler.optimizer)
        steps = {int(state["step"]) for state in optimizer.state.values()}
    finally:
        scheduler.close()
    assert steps == {8}
    for record in records:
        assert record["optimizer_steps"] == 4 and record["clip_fraction"] == 0.0
        assert record["last_iteration/clip_fraction"] > 0.0
    assert records[1]["engine_logprob_max_abs_diff"] < 1e-4
    with pytest.raises(ValueError, match="at most prompts_per_step"):
        GRPOConfig(prompts_per_step=2, steps_per_generation=3)


def test_vespo_takes_the_importance_sampling_weights_into_its_gamma_weights():
    from colo.grpo.loss import gamma_weights

    new, old, _, advantages, mask = tensors(seed=11)
    weights = torch.rand(new.shape, generator=torch.Generator().manual_seed(2)) + 0.5
    for is_weights in (weights, weights[:, :1], None):
        mine = gamma_weights(advantages.unsqueeze(1), new - old, mask, is_weights, 2.0, 3.0, 3.0, 2.0)
        theirs = trl_gamma_weights(advantages.unsqueeze(1), new - old, mask, is_weights, 2.0, 3.0, 3.0, 2.0)
        torch.testing.assert_close(mine, theirs)
        assert mine.shape == (4, 1) and bool((mine > 0).any())


def test_every_setting_is_defined_once_with_its_flag_and_its_line_in_the_docs():
    """Every GRPOConfig field is a setting (colo.grpo.settings) with its flag, or with cli=False and a help
    saying why no flag sets it; docs/grpo.md's table is the one the settings make; every other flag has
    its line there."""
    import dataclasses
    from pathlib import Path

    from colo.grpo.cli import build_parser
    from colo.grpo.settings import flagged, settings
    from colo.grpo.settings_docs import TABLE_BEGIN, TABLE_END, docs_table

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    library_only = {name: about for name, about in settings(GRPOConfig).items() if not about.cli}
    assert fields == set(settings(GRPOConfig)) and fields - set(flagged(GRPOConfig)) == set(library_only)
    assert all(about.help for about in library_only.values()) and "memory_phases" in library_only
    docs = (Path(__file__).parents[2] / "docs" / "grpo.md").read_text()
    table = docs[docs.index(TABLE_BEGIN) + len(TABLE_BEGIN):docs.index(TABLE_END)].strip()
    assert table == docs_table(GRPOConfig).strip(), "docs/grpo.md: run python -m colo.grpo.settings_docs --write"
    flags = {o: a.dest for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert [flag for flag in flags if flag != "--help" and f"`{flag}" not in docs] == []


def test_settings_trl_has_take_trls_name_and_default_or_say_why_not():
    """Each setting's TRL name is a field of TRL's GRPOConfig, and colo's default (a user's dataset's) is
    TRL's unless the setting says why not."""
    import dataclasses

    from colo.grpo.settings import field_default, settings

    trl = pytest.importorskip("trl")
    theirs = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    for name, about in settings(GRPOConfig).items():
        if about.trl is None:
            continue
        names = [n.strip() for n in about.trl.split(",")]
        assert all(n in theirs for n in names), (name, about.trl)
        ours = about.presets.get("dataset", field_default(GRPOConfig, name))
        trls = tuple(theirs[n].default for n in names) if len(names) > 1 else theirs[names[0]].default
        if about.not_trls_default:
            assert ours != trls, f"{name}: the default is TRL's now; drop not_trls_default"
        else:
            # an empty tuple or dict where TRL's None or "none" says the same
            assert ours == trls or (ours in ((), {}) and trls in (None, "none")), (name, ours, trls)


def test_an_unknown_flag_or_yaml_key_names_the_closest_setting(tmp_path, capsys):
    from colo.grpo.cli import build_parser, parse_args

    base = ["--steps", "1", "--json", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "out")]
    for argv, said in ((["--lerning-rate", "1e-5"], "unrecognized flag --lerning-rate (did you mean --lr?)"),
                       (["--max-new-token-count", "3"], "did you mean --max-new-tokens?")):
        with pytest.raises(SystemExit):
            parse_args(build_parser(), [*base, *argv])
        assert said in capsys.readouterr().err
    (tmp_path / "run.yaml").write_text("learning_rate: 1e-5\nnum_iteration: 2\n")   # TRL's name is a key
    with pytest.raises(SystemExit):
        parse_args(build_parser(), [*base, "--config", str(tmp_path / "run.yaml")])
    assert "unknown setting 'num_iteration' (did you mean num_iterations?)" in capsys.readouterr().err
    (tmp_path / "run.yaml").write_text("learning_rate: 1e-5\nmax_completion_length: 7\ngradient_checkpointing: on\n"
                                       "no_bias_correction_kl: true\n")
    args = parse_args(build_parser(), [*base, "--config", str(tmp_path / "run.yaml")])
    from colo.grpo.settings import values_from_flags

    assert values_from_flags(args, GRPOConfig) == {"learning_rate": 1e-5, "max_new_tokens": 7,
                                                   "gradient_checkpointing": True, "use_bias_correction_kl": False}


def test_disable_dropout_trains_what_the_engine_serves(tmp_path):
    """TRL's disable_dropout: a model whose config has dropout trains, by default, with it (the training
    forward is not what the engine computed, engine_logprob_max_abs_diff says so); with disable_dropout
    the trainer computes what the engine serves."""
    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model

    model_dir = build_toy_model(tmp_path / "model")
    saved = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**saved, "attention_dropout": 0.5}))
    task = ToyTask(512)
    gaps = {}
    for disable in (False, True):
        config = GRPOConfig(prompts_per_step=2, num_generations=4, ignore_eos=True, save_every=0, dtype="fp32",
                            disable_dropout=disable)
        scheduler = GRPOScheduler(model_dir, task.rewards, task.prompts, config)
        try:
            gaps[disable] = scheduler.train_step()["engine_logprob_max_abs_diff"]
        finally:
            scheduler.close()
    assert gaps[False] > 1e-2 and gaps[True] < 1e-4, gaps


def test_a_kl_reference_is_the_frozen_starting_model_through_a_checkpoint_and_resume(tmp_path):
    """beta > 0 with full fine-tuning: the reference (colo.shared.FrozenCopy) is the starting model while
    the policy trains away from it (the KL grows above 0), a checkpoint keeps it, and a resumed run
    compares with the same weights."""
    from safetensors.torch import load_file

    from colo.grpo import GRPOConfig, GRPOScheduler, ToyTask, build_toy_model

    model_dir = build_toy_model(tmp_path / "model")
    start = load_file(model_dir / "model.safetensors")
    task = ToyTask(512)
    config = GRPOConfig(prompts_per_step=2, num_generations=4, ignore_eos=True, save_every=1, dtype="fp32",
                        beta=0.04, learning_rate=3e-2)
    runs = []
    for resume in (False, True):
        scheduler = GRPOScheduler(model_dir, task.rewards, task.prompts, config, out_dir=tmp_path / "out",
                                  resume=resume)
        try:
            runs.append(scheduler.run(2 if not resume else 3, progress=False))
            with scheduler.reference.model() as reference:
                kept = {n: p.detach().clone() for n, p in reference.named_parameters()}
        finally:
            scheduler.close()
        assert kept.keys() <= start.keys() and all(torch.equal(kept[n], start[n]) for n in kept)
    saved = torch.load(tmp_path / "out" / "step-000002.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(saved["reference"][n], start[n]) for n in kept)
    assert any(not torch.equal(saved["model"][n], start[n]) for n in kept)
    (first, second), (third,) = runs
    assert first["kl"] == 0.0 and 0.0 < second["kl"] and third["step"] == 3 and third["kl"] > 0.0

    # TRL's sync_ref_model: every ref_model_sync_steps optimizer steps, ref = (1 - alpha) ref + alpha policy.
    synced = dataclasses.replace(config, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.25)
    scheduler = GRPOScheduler(model_dir, task.rewards, task.prompts, synced, out_dir=tmp_path / "synced")
    try:
        scheduler.run(1, progress=False)
        with scheduler.reference.model() as reference:
            assert all(torch.equal(p, start[n]) for n, p in reference.named_parameters())   # not yet
        scheduler.run(2, progress=False)
        policy = {n: p.detach() for n, p in scheduler.model.named_parameters()}
        with scheduler.reference.model() as reference:
            for name, value in reference.named_parameters():
                torch.testing.assert_close(value, 0.75 * start[name] + 0.25 * policy[name], atol=1e-7, rtol=1e-6)
    finally:
        scheduler.close()


def test_dynamic_sampling_keeps_a_group_whose_totals_tie_under_normalize_then_sum():
    """GDPO (normalize_then_sum) normalizes each reward function within the group before the weighted
    sum: a group whose weighted totals are equal still has advantages where the functions' rewards
    differ, so dynamic sampling keeps it; summed first (TRL's default), the same group teaches nothing."""
    from colo.grpo import dynamic_sampling
    from colo.grpo.loss import normalized_sum
    from colo.grpo.task import Scores

    scores = Scores(torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]), torch.tensor([1.0, 2.0]), ("a", "b"))
    assert scores.total.tolist() == [2.0, 2.0, 3.0, 3.0]
    assert dynamic_sampling.informative_groups(scores, 2) == []
    assert dynamic_sampling.informative_groups(scores, 2, "normalize_then_sum") == [0]
    assert normalized_sum(scores.per_function, scores.weights, 2)[:2].abs().min() > 0.5


def test_the_moe_load_balancing_loss_is_trls_the_models_own_weighted_by_router_aux_loss_coef():
    """TRL 1.16 adds a MoE model's own load-balancing loss (its forward's aux_loss from the router logits)
    times router_aux_loss_coef (default: the model config's) to the loss: the gradient colo adds is that
    weight times the gradient of the model's own aux_loss, the record says aux_loss; a dense model, or a
    MoE family computing none (Llama 4), adds none, and an explicit weight for one is refused."""
    from colo.bench.models import random_model
    from colo.grpo.backward import accumulate_gradients
    from colo.grpo.batch import pack
    from colo.grpo.router_aux import router_aux_loss
    from conftest import TINY_CONFIG

    model = random_model({**TINY_CONFIG, "vocab_size": 100}, arch="qwen3_moe")
    aux = router_aux_loss(model, None)
    assert aux is not None and aux.coef == model.config.router_aux_loss_coef == 0.001
    assert router_aux_loss(model, 0.0) is None and router_aux_loss(model, 0.5).coef == 0.5
    assert router_aux_loss(random_model({**TINY_CONFIG, "vocab_size": 100}), None) is None
    assert router_aux_loss(random_model({**TINY_CONFIG, "vocab_size": 100}, arch="llama4"), None) is None
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01: Qwen2ForCausalLM computes no load-balancing"):
        router_aux_loss(random_model({**TINY_CONFIG, "vocab_size": 100}), 0.01)

    batch = pack([[3, 4, 5], [6, 7]], [[8, 9, 10, 11], [12, 13]])
    advantages = torch.tensor([1.0, -1.0])
    config = GRPOConfig(micro_batch_size=1)   # two micro-batches: each adds its share of the mean

    def gradient(with_aux):
        model.zero_grad()
        stats = accumulate_gradients(model, batch, advantages, config, num_tokens=6.0,
                                     aux=router_aux_loss(model, 0.5) if with_aux else None)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats

    plain, _ = gradient(False)
    balanced, stats = gradient(True)
    model.zero_grad()
    own = []
    for i in range(2):   # the model's own aux_loss of each row, as its forward computes it
        row = batch.rows(i, i + 1)
        own.append(model(input_ids=row.input_ids, attention_mask=row.attention_mask, position_ids=row.position_ids,
                         output_router_logits=True).aux_loss)
    (0.5 * (own[0] + own[1]) / 2).backward()
    assert any(n.endswith("mlp.gate.weight") for n in balanced)
    for name, value in balanced.items():   # the routers' and every layer's under them
        expected = model.get_parameter(name).grad
        torch.testing.assert_close(value - plain[name], torch.zeros_like(value) if expected is None else expected,
                                   atol=1e-6, rtol=1e-4)
    assert stats["aux_loss"] == pytest.approx(float(own[0] + own[1]) / 2, rel=1e-5)


def test_off_policy_sequence_masking_is_trls():
    """TRL's off_policy_mask_threshold (OPSM): a completion with a negative advantage whose mean KL from the
    sampling log-probabilities exceeds the threshold is left out of the policy term; TRL's own function
    gives the same mask, and the masked row adds no policy gradient."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    from colo.grpo.backward import accumulate_gradients
    from colo.grpo.batch import completion_logprobs, pack
    from colo.grpo.loss import off_policy_mask
    from helpers.models import one_layer_qwen2

    torch.manual_seed(0)
    advantages = torch.tensor([1.0, -1.0, -0.5, 0.0])
    current = -torch.rand(4, 5)
    sampling = current + torch.tensor([[0.9], [0.9], [0.1], [0.9]])
    sampling[2, 1] = float("nan")   # a token the engine gave nothing for
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    mine = off_policy_mask(advantages, current, sampling, mask, 0.5)
    trls = GRPOTrainer.get_off_policy_mask(advantages.unsqueeze(1), current, sampling, mask.float(), 0.5)
    assert mine.tolist() == trls.tolist() == [[1.0], [0.0], [1.0], [1.0]]

    batch = pack([[3, 4, 5], [6, 7]], [[8, 9, 10, 11], [12, 13]])
    model = one_layer_qwen2().train()
    with torch.no_grad():
        logprobs = completion_logprobs(model, batch)
    engine = [(logprobs[0, :4] + 1.0).tolist(), (logprobs[1, :2] + 1.0).tolist()]   # mean KL 1 each

    def gradient(threshold, advantages):
        model.zero_grad()
        config = GRPOConfig(off_policy_mask_threshold=threshold, micro_batch_size=1)
        accumulate_gradients(model, batch, advantages, config, num_tokens=6.0, engine_logprobs=engine)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    assert gradient(0.5, torch.tensor([-1.0, -1.0])).abs().sum() == 0          # both masked
    assert gradient(2.0, torch.tensor([-1.0, -1.0])).abs().sum() > 0           # KL under the threshold
    torch.testing.assert_close(gradient(0.5, torch.tensor([1.0, -1.0])),      # only the positive row trains
                               gradient(None, torch.tensor([1.0, 0.0])))
