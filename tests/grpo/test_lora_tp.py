"""LoRA with tensor parallelism: `python -m colo.grpo --tensor-parallel 2 --lora-rank R` on two ranks
(gloo, CPU; started as torchrun starts them, helpers/forked.py). Each rank's adapter is a view of its vLLM LoRA slot (B split for column-parallel layers,
A for row-parallel ones, as vLLM splits them), the run trains like the one-rank LoRA run, copies 0
bytes per publish, and the engine serves what the trainer computes after the step.

The tiny model has 2 attention heads and 1 KV head: at TP=2 both ranks hold the KV head, so its
adapter B is shared too and its gradient summed (the case that is not a plain split).
"""
from __future__ import annotations

import json

import pytest
import torch

from colo.lora import read_adapter
from helpers.grpo_runs import records, run_grpo, run_grpo_ranks

pytestmark = pytest.mark.slow

LR, ALPHA, RANK = 3e-2, 16, 8  # a large step: the served adapter after it is far from the base
SCALE = ALPHA / RANK  # the slot (and a checkpoint) holds B x alpha/rank (vLLM's convention)
COMMON = ("--steps", "2", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lr", str(LR), "--dtype", "fp32",
          "--eager", "--prompts-per-step", "2", "--num-generations", "4", "--save-every", "1",
          "--keep-checkpoints", "0")




def adapter_state(out, step: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"step-{step:06d}.pt", map_location="cpu", weights_only=True)["model"]


def test_tensor_parallel_lora_trains_like_one_rank_in_the_engines_slots(tmp_path, tiny_model_dir):
    model = tiny_model_dir("qwen2")
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    run_grpo(one, *COMMON, "--model", str(model))
    run_grpo_ranks(two, 2, *COMMON, "--model", str(model), "--tensor-parallel", "2")
    a, b = records(one), records(two)
    assert [r["step"] for r in b] == [1, 2]
    for r in b:
        assert r["publish_bytes_copied"] == 0  # the optimizer wrote into the engines' slots
        # fp32 engine and trainer over the same slot; step 2's completions were sampled after step 1's
        # update, so its comparison is the served adapter against the trained one.
        assert r["engine_logprob_max_abs_diff"] < 1e-4
    # An engine's ranks sample with the same seeds: the one-rank run's completions.
    assert b[0]["tokens_generated"] == a[0]["tokens_generated"] and b[0]["reward_mean"] == a[0]["reward_mean"]
    # The same step up to fp32 summation order (o_proj/down_proj products and the vocabulary softmax
    # split in two): a few ulp (2^-24) of the terms, which GRPO's advantages of both signs cancel to
    # about 1/100 of their size: a relative gap of order 1e-5 at most, bounded by 1e-4 (test_grpo_tp).
    # The loss is about 0 (on-policy ratios of 1 times advantages that sum to 0): absolute.
    assert b[0]["grad_norm"] == pytest.approx(a[0]["grad_norm"], rel=1e-4)
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], abs=1e-6)
    # All-reduces of one step (one micro-batch), L layers: forward 2 per layer, the embedding and 3
    # for the log-probabilities; backward the attention and MLP inputs but layer 0's (the base is
    # frozen, nothing below needs a gradient) and the LM head's input; and the adapter pieces the
    # ranks hold alike: A of q/k/v/gate/up and B of o/down (whole on both) and B of the shared KV head's
    # k/v, 9 per layer.
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert all(r["tp_all_reduces"] == (2 * layers + 4) + (2 * layers) + 9 * layers for r in b)

    # Whole adapters in the checkpoints (gathered from the ranks' parts), named and shaped as one rank's.
    first_one, first_two = adapter_state(one, 1), adapter_state(two, 1)
    assert first_one.keys() == first_two.keys()
    for name, value in first_one.items():
        assert first_two[name].shape == value.shape, name
        if name.endswith("lora_A"):
            # B starts at 0, so A's first gradient is exactly 0: A is PEFT's init, drawn whole from the
            # same seed and sliced by the ranks, then gathered back: bit for bit.
            assert torch.equal(first_two[name], value), name
    # B's first AdamW update is lr x scale x g / (|g| + eps) per element: the runs agree where |g| is well
    # above eps, and where g is within fp32 rounding of 0 its sign and size are noise (at most 2 lr x
    # scale apart); such elements are rare.
    gaps = torch.cat([(first_two[n] - v).abs().flatten() for n, v in first_one.items() if n.endswith("lora_B")])
    assert float(gaps.max()) <= 2 * LR * SCALE * (1 + 1e-6)
    assert float(gaps.mean()) < 1e-3 * LR

    # The adapter in PEFT's format is the checkpoint's whole adapter (B in PEFT's units).
    last = adapter_state(two, 2)
    spec, exported = read_adapter(two / "adapter")
    assert (spec.rank, spec.alpha) == (RANK, ALPHA)
    for name, value in last.items():
        module, _, which = name.rpartition(".")
        expected = value / (SCALE if which == "lora_B" else 1.0)
        torch.testing.assert_close(exported[f"base_model.model.{module}.{which}.weight"], expected, atol=0, rtol=0)
    assert sorted(p.name for p in two.glob("step-000001.optimizer-*")) == [
        "step-000001.optimizer-tp0-of-2.pt", "step-000001.optimizer-tp1-of-2.pt"]

