"""colo.grpo.prompt_sharing: the rows of a micro-batch that share a prompt compute it once, with the packed
forward's log-probabilities, entropies and gradients (within the packed forward's own rounding, in fp32
and in bf16), fewer positions, and micro-batches that keep a prompt's rows together; where it cannot
apply, the packed forward runs."""
import copy

import pytest
import torch
from conftest import tiny_hf_model

from colo.grpo.backward import FILL, backward_rollout, length_buckets, rollout_logprobs
from colo.grpo.batch import Rollout, completion_logprobs, pack
from colo.grpo.config import GRPOConfig
from colo.grpo.logprobs import completion_logprobs_chunked
from colo.grpo.prompt_sharing import (computed_positions, prompt_cache_fits, prompt_groups, shared_prompt_buckets,
                                      shared_prompt_logprobs, shares_prompts)

VOCAB = 1000
# Three prompts, two of them shared (3 and 2 rows), left-padded; completions of different lengths.
PROMPTS = [[1, 2, 3, 4, 5]] * 3 + [[7, 8]] * 2 + [[9, 10, 11, 12, 13, 14, 15]]
COMPLETION_LENGTHS = (11, 4, 9, 3, 1, 6)


def _batch():
    g = torch.Generator().manual_seed(0)
    return pack(PROMPTS, [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in COMPLETION_LENGTHS])


def _run(model, batch, way):
    """Log-probabilities, entropies and every parameter's gradient of a loss weighing each token differently."""
    model.zero_grad(set_to_none=True)
    entropies = []
    if way == "packed":
        logprobs = completion_logprobs_chunked(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                               batch.completion_ids, 0.7, entropies=entropies)
    else:
        logprobs = shared_prompt_logprobs(model, batch, 0.7, entropies)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs) * batch.completion_mask
    (logprobs * weights).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    return logprobs.detach().double(), entropies[0].double(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("llama", False), ("qwen3", False)])
def test_a_shared_prompt_gives_the_packed_forwards_logprobs_and_gradients(dtype, arch, tied):
    """Against the same weights in float64, the shared forward's error is within twice the packed forward's
    own (its rounding in the model's dtype is the scale), for log-probabilities, entropies and each
    parameter's gradient; the prompts ran once each and the completions' last token not at all."""
    model = tiny_hf_model(arch, vocab_size=VOCAB, tie_word_embeddings=tied, dtype=dtype).train()
    exact = copy.deepcopy(model).double()
    batch = _batch()
    assert prompt_cache_fits(model) and shares_prompts(model, batch)
    rows_embedded = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: rows_embedded.append(tuple(args[0].shape)))
    truth = _run(exact, batch, "packed")
    packed = _run(model, batch, "packed")
    rows_embedded.clear()
    shared = _run(model, batch, "shared")

    assert rows_embedded == [(3, 7), (6, 10)]   # 3 distinct prompts of 7 columns, 6 rows of 11 - 1 columns
    mask = batch.completion_mask.bool()
    floor = 8 * torch.finfo(dtype).eps
    for name, got, packed_got, expected in zip(("logprobs", "entropies"), shared[:2], packed[:2], truth[:2]):
        packed_error = float((packed_got - expected)[mask].abs().max())
        assert float((got - expected)[mask].abs().max()) <= 2 * packed_error + floor, name
    for name, expected in truth[2].items():
        assert expected.abs().max() > 0, name   # every parameter takes part
        packed_error = float((packed[2][name] - expected).norm() / expected.norm())
        assert float((shared[2][name] - expected).norm() / expected.norm()) <= 2 * packed_error + floor, name


def test_the_positions_computed_count_each_prompt_once():
    model, batch = tiny_hf_model("llama", vocab_size=VOCAB), _batch()
    positions, padded = computed_positions(model, batch)
    # 3 distinct prompts x 7 columns (14 real), 6 rows x the 11 - 1 completion columns the head reads from
    # (each row's tokens in them real, the longest row's last token never input)
    real_completion = sum(min(n, 10) for n in COMPLETION_LENGTHS)
    assert (positions, padded) == (3 * 7 + 6 * 10, 3 * 7 - 14 + 6 * 10 - real_completion)
    assert positions < batch.attention_mask.numel()


def test_where_it_cannot_apply_the_packed_forward_runs(monkeypatch):
    import colo.grpo.batch as batch_module

    batch = _batch()
    distinct = pack([[1, 2], [3, 4, 5]], [[6, 7], [8]])
    assert prompt_groups(distinct) is None and prompt_groups(batch)[1].tolist() == [1, 1, 1, 0, 0, 2]
    # A sliding window (Mistral's default): its cache keeps a window, not every prompt position.
    assert not prompt_cache_fits(tiny_hf_model("mistral", vocab_size=VOCAB))
    model = tiny_hf_model("qwen2", vocab_size=VOCAB).train()
    assert not shares_prompts(model, batch, router_logits=True)   # a MoE's router logits are per packed position
    routed = copy.copy(batch)
    routed.routes = torch.zeros(len(batch), 1)
    assert not shares_prompts(model, routed)
    # Gradient checkpointing: transformers' layers drop the cache.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not prompt_cache_fits(model)
    calls = []
    monkeypatch.setattr(batch_module, "shared_prompt_logprobs", lambda *a, **k: calls.append("shared"))
    completion_logprobs(model, batch)
    assert calls == [] and computed_positions(model, batch)[0] == batch.attention_mask.numel()


def test_the_old_policys_logprobs_take_the_forward_training_takes(monkeypatch):
    """rollout_logprobs asked for a MoE's router logits (its load-balancing loss trains): the packed
    forward in length_buckets' micro-batches, as backward_rollout's; otherwise the shared one."""
    import colo.grpo.batch as batch_module

    model = tiny_hf_model("qwen3_moe", vocab_size=VOCAB)
    completions = [[5, 6, 7], [8, 9], [10], [11, 12]]
    rollout = Rollout(rows=[0, 0, 1, 1], prompts=[[1, 2, 3]] * 2 + [[4]] * 2, completions=completions,
                      logprobs=[None] * 4, truncated=[False] * 4)
    calls = []
    real = batch_module.shared_prompt_logprobs
    monkeypatch.setattr(batch_module, "shared_prompt_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = GRPOConfig()
    rollout_logprobs(model, rollout, config, device="cpu", router_logits=True)
    assert calls == []
    rollout_logprobs(model, rollout, config, device="cpu")
    assert calls


def test_a_prompts_rows_train_together_and_the_gradient_is_every_row_alones():
    """backward_rollout on a model the sharing fits: the micro-batches keep each prompt's rows together, and
    the gradient is the one of each row trained alone (fp32, float summation order apart)."""
    model = tiny_hf_model("qwen2", vocab_size=VOCAB).train()
    g = torch.Generator().manual_seed(1)
    prompts = [[1, 2, 3]] * 4 + [[4, 5, 6, 7, 8, 9]] * 4
    completions = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (6, 5, 6, 4, 3, 5, 5, 2)]
    rollout = Rollout(rows=[0] * 4 + [1] * 4, prompts=prompts, completions=completions, logprobs=[None] * 8,
                      truncated=[False] * 8)
    advantages = torch.linspace(-1.0, 1.0, 8)
    tokens = float(sum(map(len, completions)))

    def gradient(micro_batch_size):
        model.zero_grad(set_to_none=True)
        stats = backward_rollout(model, rollout, advantages, GRPOConfig(micro_batch_size=micro_batch_size),
                                 device="cpu", dp_size=1, global_tokens=tokens, global_sequences=8.0)
        return torch.cat([p.grad.flatten() for p in model.parameters()]), stats

    together, stats = gradient(None)
    alone, single = gradient(1)
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-5)
    assert stats["loss"] == pytest.approx(single["loss"], abs=1e-6)
    # Each prompt's rows one micro-batch (joined, the short prompt padded to 6 columns, they would fill 45 of
    # 60 positions, under FILL), each prompt computed once: its columns, its rows to its longest completion - 1.
    assert stats["positions"] == (3 + 4 * 5) + (6 + 4 * 4) < single["positions"]


def test_shared_prompt_buckets_keep_a_prompts_rows_together_within_the_caps():
    # GRPO's shape: 4 prompts x 4 completions, completions of similar lengths: one micro-batch.
    prompts = [[p] * 30 for p in range(4) for _ in range(4)]
    lengths = [32, 30, 31, 29] * 4
    assert shared_prompt_buckets(prompts, lengths, None, 4096, FILL) == [
        [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15]]
    # A row cap, and a positions cap under one prompt's rows: each micro-batch one prompt's rows, within the caps.
    for most_rows, most_positions in ((4, 4096), (16, 30 + 2 * 32)):
        buckets = shared_prompt_buckets(prompts, lengths, most_rows, most_positions, FILL)
        assert sorted(i for b in buckets for i in b) == list(range(16))
        for bucket in buckets:
            assert len({tuple(prompts[i]) for i in bucket}) == 1
            assert len(bucket) <= most_rows and 30 + len(bucket) * 32 <= most_positions
    # A row cap that leaves one row of each prompt over: those rows join, their prompts each once.
    assert shared_prompt_buckets(prompts, lengths, 3, 4096, FILL) == [
        [0, 2, 1], [4, 6, 5], [8, 10, 9], [12, 14, 13], [3, 7, 11], [15]]
    # One long completion among short ones: cut off, so the others are not padded to it.
    assert shared_prompt_buckets([[1, 2]] * 4, [60, 3, 4, 3], None, 4096, FILL) == [[0], [2, 1, 3]]
    # No prompt shared: length_buckets' micro-batches.
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        p_lengths = torch.randint(1, 20, (12,), generator=g).tolist()
        c_lengths = torch.randint(0, 40, (12,), generator=g).tolist()
        distinct_prompts = [[i] * n for i, n in enumerate(p_lengths)]
        assert shared_prompt_buckets(distinct_prompts, c_lengths, 5, 200, FILL) == \
            length_buckets(p_lengths, c_lengths, 5, most_positions=200)
