"""colo.grpo.checkpoint: checkpoints are written atomically, numbered and pruned, a damaged or foreign
file is a clear error, and the RNG state round-trips (no engine, fast). Whole runs resuming from
them: test_grpo_run.py."""
import pytest
import torch

from colo.grpo.checkpoint import (CheckpointError, capture_rng, latest_checkpoint, list_checkpoints,
                                  load_checkpoint, restore_rng, save_checkpoint)


def _state(value=1.0):
    return {"model": {"w": torch.full((3,), value)}, "optimizer": {}, "rng": [capture_rng()], "config": {}}


def test_checkpoints_are_atomic_numbered_and_pruned(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    # A run killed mid-write leaves a .tmp file: never picked up, and removed by the next save.
    (tmp_path / "step-000009.pt.tmp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step-000003.pt"
    save_checkpoint(tmp_path, 4, _state(4), keep=2)
    assert not list(tmp_path.glob("*.tmp"))
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 4 and state["model"]["w"].tolist() == [4.0, 4.0, 4.0]


def test_unreadable_or_foreign_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "step-000001.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="is not a colo GRPO checkpoint .step-N.pt., or is damaged"):
        load_checkpoint(bad)
    torch.save({"something": "else"}, tmp_path / "step-000002.pt")
    with pytest.raises(CheckpointError, match="not a colo GRPO checkpoint"):
        load_checkpoint(tmp_path / "step-000002.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")


def test_rng_state_round_trips():
    state = capture_rng()
    expected = (torch.rand(3), __import__("random").random())
    torch.rand(5)
    restore_rng(state)
    assert torch.equal(torch.rand(3), expected[0]) and __import__("random").random() == expected[1]
