"""colo.grpo.metrics: the step log (JSON lines) drops what a killed run wrote past the checkpoint it
resumes from, and the timeline is a Chrome trace whether closed, killed or resumed (no engine, fast)."""
import json

from colo.grpo.metrics import StepLog, Timeline


def test_step_log_drops_records_past_the_resumed_checkpoint(tmp_path):
    path = tmp_path / "log.jsonl"
    log = StepLog(path)
    for step in range(1, 6):
        log.write({"step": step})
    with open(path, "a") as f:
        f.write('{"step": 6, "rew')  # the half-written line of a killed run
    StepLog(path, resume_after_step=3).write({"step": 4, "again": True})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["again"]


def test_timeline_is_a_chrome_trace_closed_killed_or_resumed(tmp_path):
    path = tmp_path / "trace.json"
    tl = Timeline(path, rank=0)
    with tl.span("generate", step=1) as span:
        pass
    tl.counter("resident_bytes", {"kv_cache": 5})
    # A killed run leaves the array open: the format allows it, readers close it.
    events = json.loads(path.read_text().rstrip().rstrip(",") + "]")
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans[0]["name"] == "generate" and spans[0]["dur"] >= 0 and span["seconds"] >= 0
    assert any(e.get("ph") == "C" and e["args"] == {"kv_cache": 5} for e in events)
    tl.close()
    assert len(json.loads(path.read_text())) == len(events) + 1  # strict JSON once closed
    resumed = Timeline(path, rank=0, append=True)
    with resumed.span("train", step=2):
        pass
    resumed.close()
    names = [e["name"] for e in json.loads(path.read_text()) if e.get("ph") == "X"]
    assert names == ["generate", "train"]
