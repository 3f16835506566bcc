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


def test_a_run_is_checked_once_and_its_checkpoint_read_once_before_any_engine(tmp_path, monkeypatch, capsys):
    """colo.grpo.preflight.check_run refuses a bad model, an unwritable out_dir and a resume with no
    checkpoint; the CLI makes the same checks itself (usage errors naming the flag) and reads the
    checkpoint a resumed run continues from once, for the scheduler to take as it is."""
    import json

    from colo.grpo import GRPOConfig, build_toy_model, checkpoint, cli
    from colo.grpo.preflight import CheckedRun, check_run

    model_dir = build_toy_model(tmp_path / "model")
    out = tmp_path / "out"
    config = GRPOConfig()
    assert check_run(model_dir, config, out_dir=out) == CheckedRun(model_dir, out, None)
    with pytest.raises(FileNotFoundError, match="config.json missing"):
        check_run(tmp_path, config)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="out_dir .*cannot write there"):
        check_run(model_dir, config, out_dir=tmp_path / "file" / "out")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        check_run(model_dir, config, out_dir=out, resume=True)

    save_checkpoint(out, 2, _state(2.0))
    (out / "run.json").write_text(json.dumps({"model_dir": str(model_dir), "config": config.to_dict()}))
    reads = []
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda path: reads.append(path) or {"step": 2})
    parser = cli.build_parser()
    args = cli.parse_args(parser, ["--steps", "3", "--resume", "--json", str(tmp_path / "l.jsonl"), "--out", str(out)])
    resumed_dir, _, resume_from = cli._settings(args, parser)
    assert resumed_dir == model_dir and resume_from == (out / "step-000002.pt", {"step": 2}) and len(reads) == 1
    (model_dir / "config.json").unlink()
    with pytest.raises(SystemExit):
        cli._settings(args, parser)
    assert "--resume: no Hugging Face model at" in capsys.readouterr().err
