"""colo.grpo.trackers: step records go to TensorBoard, W&B and Trackio through their own writers, and
read back from what each wrote to disk (no network: W&B offline, Trackio's local store)."""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import struct
import sys
import zlib

import pytest

from colo.grpo.trackers import Trackers, check_report_to, scalars

# Step records as colo.grpo writes them: numbers, a bool, a string, None, a list, a nested dict, and a
# NaN (the reward of a step whose completions were all unscored).
RECORDS = [
    {"step": 1, "reward_mean": 0.25, "generate_s": 1.5, "dtype": "bfloat16", "overlap": True, "serial_reason": None,
     "lengths": [3, 4], "eval": {"math": 0.5}, "tokens_generated": 96},
    {"step": 2, "reward_mean": 0.5, "generate_s": 1.25, "dtype": "bfloat16", "overlap": False, "serial_reason": "x",
     "lengths": [5], "eval": {"math": 0.75}, "tokens_generated": 120},
    {"step": 3, "reward_mean": float("nan"), "generate_s": 1.0, "dtype": "bfloat16", "overlap": True,
     "serial_reason": None, "lengths": [], "eval": {"math": 1.0}, "tokens_generated": 64},
]
# What each tracker must hold: per key, the (step, value) series. Written out, not derived.
EXPECTED = {
    "reward_mean": [(1, 0.25), (2, 0.5), (3, math.nan)],
    "generate_s": [(1, 1.5), (2, 1.25), (3, 1.0)],
    "overlap": [(1, 1), (2, 0), (3, 1)],
    "eval/math": [(1, 0.5), (2, 0.75), (3, 1.0)],
    "tokens_generated": [(1, 96), (2, 120), (3, 64)],
}
CONFIG = {"learning_rate": 1e-6, "num_generations": 4, "dtype": "bfloat16", "lora": {"rank": 8}}


def same(got, expected) -> bool:
    if isinstance(expected, float) and math.isnan(expected):
        return math.isnan(got)
    return got == pytest.approx(expected)  # TensorBoard keeps float32


def assert_series(got: dict[str, list[tuple[int, float]]]) -> None:
    """`got` is exactly EXPECTED: the same keys (none of the strings, Nones or lists; not "step"),
    the same steps, the same values."""
    assert sorted(got) == sorted(EXPECTED)
    for key, series in EXPECTED.items():
        assert [s for s, _ in got[key]] == [s for s, _ in series], key
        assert all(same(g, e) for (_, g), (_, e) in zip(got[key], series)), (key, got[key])


def log_all(names, tmp_path, run_name="run-1") -> None:
    with Trackers(names, run_name=run_name, config=CONFIG, log_dir=tmp_path) as t:
        for record in RECORDS:
            t.log(record)
        t.close()  # and again on leaving the block: close is idempotent


# -- check_report_to -------------------------------------------------------------------------------
def hide(monkeypatch, *modules):
    """Make importlib.util.find_spec report `modules` as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


def test_check_report_to_names():
    assert check_report_to(None) == check_report_to([]) == check_report_to(["none"]) == ()
    assert check_report_to(["wandb", "tensorboard", "wandb"]) == ("wandb", "tensorboard")
    assert check_report_to(["all"]) == ("tensorboard", "wandb", "trackio")  # all three are installed here
    with pytest.raises(ValueError, match="--report-to mlflow: unknown tracker; choose from tensorboard, wandb, "):
        check_report_to(["tensorboard", "mlflow"])
    for special in ("none", "all"):
        with pytest.raises(ValueError, match=f"--report-to {special} cannot be combined"):
            check_report_to([special, "wandb"])


def test_check_report_to_missing_package(monkeypatch):
    hide(monkeypatch, "wandb")
    with pytest.raises(ValueError) as e:
        check_report_to(["tensorboard", "wandb"])
    assert str(e.value) == "--report-to wandb: the wandb package is not installed; pip install 'colo[wandb]'"
    assert check_report_to(["all"]) == ("tensorboard", "trackio")
    hide(monkeypatch, "wandb", "tensorboard", "trackio")
    with pytest.raises(ValueError, match="--report-to all: none of tensorboard, wandb, trackio is installed"):
        check_report_to(["all"])


def test_no_tracker_writes_nothing(tmp_path):
    log_all(["none"], tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_scalars_flatten_and_skip():
    assert scalars({"a": 1, "b": True, "c": "s", "d": None, "e": [1.0], "f": {"g": {"h": 2.5}, "i": "x"}}) == {
        "a": 1, "b": 1, "f/g/h": 2.5}


# -- TensorBoard -----------------------------------------------------------------------------------
def test_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(["tensorboard"], tmp_path)
    events = EventAccumulator(str(tmp_path / "runs" / "run-1"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert_series({tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]})
    (text,) = events.Tensors("config/text_summary")
    markdown = text.tensor_proto.string_val[0].decode()
    assert markdown.startswith("```json\n") and json.loads(markdown.strip("`").removeprefix("json")) == CONFIG


def test_failed_start_closes_the_writers_already_open(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def refuse(*args):
        raise RuntimeError("wandb.init failed")

    monkeypatch.setattr(Trackers, "_open_wandb", staticmethod(refuse))
    with pytest.raises(RuntimeError, match="wandb.init failed"):
        Trackers(["tensorboard", "wandb"], run_name="run-1", config=CONFIG, log_dir=tmp_path)
    # The config text reaches the event file only when the writer is flushed (its queue holds ten).
    events = EventAccumulator(str(tmp_path / "runs" / "run-1"))
    events.Reload()
    assert events.Tags()["tensors"] == ["config/text_summary"]


# -- Weights & Biases (offline) --------------------------------------------------------------------
def wandb_records(path):
    """The records of a .wandb file: LevelDB's log format (32 KiB blocks of chunks, each with a CRC-32,
    length and type: FULL, or FIRST MIDDLE* LAST) after a 7-byte ':W&B' header; each record is a
    wandb_internal_pb2.Record. wandb 0.31 ships no Python reader (wandb-core, in Go, writes it)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = open(path, "rb").read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a chunk header: zero padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline(tmp_path, monkeypatch):
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.delenv("WANDB_DIR", raising=False)  # so the run's files go to log_dir
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "colo-test")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's captured streams alone
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_all(["wandb"], tmp_path / "logs")
    # run.finish() returns once wandb-core has handled the run's exit, but wandb-core closes the
    # run's .wandb file after that, on its own time (seen here under load: only the 7-byte header on
    # disk in some runs). teardown() waits for wandb-core to stop, as a process's exit hook does.
    import wandb

    wandb.teardown()

    (path,) = glob.glob(str(tmp_path / "logs" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = list(wandb_records(path))
    (run,) = [r.run for r in records if r.HasField("run")]
    assert (run.project, run.display_name) == ("colo-test", "run-1")
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    assert config == CONFIG
    got = {}
    for history in (r.history for r in records if r.HasField("history")):
        for item in history.item:
            key = item.key or "/".join(item.nested_key)  # wandb-core fills one or the other
            if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                got.setdefault(key, []).append((history.step.num, json.loads(item.value_json)))
    assert_series(got)
    assert any(r.HasField("exit") for r in records)  # finished, not left running


# -- Trackio (local store) -------------------------------------------------------------------------
def test_trackio_local(tmp_path, monkeypatch):
    # trackio reads TRACKIO_DIR once, at import: import it afresh (monkeypatch puts back any copy
    # imported before) so that this run's store is tmp_path, not ~/.cache/huggingface/trackio.
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRACKIO_PROJECT", "colo-test")
    for name in [name for name in sys.modules if name == "trackio" or name.startswith("trackio.")]:
        monkeypatch.delitem(sys.modules, name)
    from trackio.sqlite_storage import SQLiteStorage

    log_all(["trackio"], tmp_path / "logs", run_name="run-1")

    assert SQLiteStorage.get_project_db_path("colo-test").parent == tmp_path / "trackio"
    logs = SQLiteStorage.get_logs("colo-test", "run-1")
    assert_series({key: [(row["step"], row[key]) for row in logs if key in row]
                   for key in {key for row in logs for key in row} - {"step", "timestamp"}})
    config = SQLiteStorage.get_run_config("colo-test", "run-1")
    assert {key: value for key, value in config.items() if not key.startswith("_")} == CONFIG
