"""python -m colo.bench.trl_task counts the FLOPs of TRL's model passes from the shapes TRL passes."""
from types import SimpleNamespace

import pytest
import torch

from colo.bench.measure import matmul_parameters
from colo.bench.trl_task import _count_train_flops, main


def test_the_passes_flops_are_the_body_on_every_position_and_the_head_on_the_kept_ones():
    config = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000)
    seen = []
    trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m),
                              model=SimpleNamespace(config=config),
                              _get_per_token_logps_and_entropies=lambda *a, **k: seen.append(a) or "out")
    clock = SimpleNamespace(steps=[{}])  # inside the second step
    flops = _count_train_flops(trainer, clock)
    ids = torch.zeros(8, 40, dtype=torch.long)
    with torch.no_grad():
        assert trainer._get_per_token_logps_and_entropies("model", ids, None, 16) == "out"
    trainer._get_per_token_logps_and_entropies("model", ids, None, 16)  # with its backward
    body = matmul_parameters(config) - 64 * 1000
    forward = 2 * (body * 8 * 40 + 64 * 1000 * 8 * 16)
    assert flops == {1: forward + 3 * forward} and len(seen) == 2


def test_fewer_than_two_steps_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--steps", "1", "--json", str(tmp_path / "x.json")])


def test_rounds_are_merged_into_medians_and_kept():
    from colo.bench.trl_task import over_rounds

    rounds = [{"wall_s": 3.0, "steps_measured": 3, "engine_dtype": "bf16", "reward_per_step": [0.1]},
              {"wall_s": 1.0, "steps_measured": 3, "engine_dtype": "bf16", "reward_per_step": [0.2]},
              {"wall_s": 2.0, "steps_measured": 3, "engine_dtype": "bf16", "reward_per_step": [0.3]}]
    merged = over_rounds(rounds)
    assert merged["wall_s"] == 2.0 and merged["steps_measured"] == 3 and merged["engine_dtype"] == "bf16"
    assert merged["reward_per_step"] == [0.1] and merged["rounds"] == rounds
    assert over_rounds(rounds[:1]) == rounds[0]


def test_no_rounds_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--rounds", "0", "--json", str(tmp_path / "x.json")])
