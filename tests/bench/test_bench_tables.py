"""`python -m colo.bench.tables`: the READMEs' measured tables are what bench/results gives, and follow it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colo.bench import tables

REPO = Path(__file__).resolve().parents[2]


def test_readmes_match_the_results_files():
    done = subprocess.run([sys.executable, "-m", "colo.bench.tables", "--check"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, "run `python -m colo.bench.tables`:\n" + done.stdout[-4000:] + done.stderr[-2000:]


@pytest.fixture
def repo_copy(tmp_path):
    """The two READMEs and bench/results, copied where a test may change them."""
    shutil.copytree(REPO / "bench" / "results", tmp_path / "bench" / "results")
    for readme in tables.READMES:
        shutil.copy(REPO / readme, tmp_path / readme)
    return tmp_path


def edit_rows(path: Path, change) -> None:
    result = json.loads(path.read_text())
    for row in result["rows"]:
        change(row)
    path.write_text(json.dumps(result, indent=1))


def test_a_changed_figure_changes_its_table_and_only_the_tables(repo_copy, capsys):
    before = (repo_copy / "bench" / "README.md").read_text()
    assert "| 358M params | 5.44 s (1.17x) | 2.60 s (2.46x) |" in before

    def slower_lora_step(row):
        if row.get("case") == "LoRA step qwen2-trl-0.36B: colo.grpo scheduler":
            row["colo_s"], row["ratio"] = 3.25, row["baseline_s"] / 3.25

    edit_rows(repo_copy / "bench" / "results" / tables.LORA_FULL, slower_lora_step)
    assert tables.main(["--check", "--root", str(repo_copy)]) == 1
    assert "+| 358M params | 5.44 s (1.17x) | 3.25 s (1.97x) |" in capsys.readouterr().out
    assert (repo_copy / "bench" / "README.md").read_text() == before  # --check writes nothing

    assert tables.main(["--root", str(repo_copy)]) == 0
    after = (repo_copy / "bench" / "README.md").read_text()
    changed = [(old, new) for old, new in zip(before.splitlines(), after.splitlines(), strict=True) if old != new]
    assert changed == [(
        ("| 358M params | 5.44 s (1.17x) | 2.60 s (2.46x) | 6.39 s | 0 bytes in 3.13 ms / 1.33 GiB in 991 ms | "
         "692 MiB / 2.02 GiB | 0 bytes / 4.88 GiB | 2.38 GiB / 8.10 GiB |"),
        ("| 358M params | 5.44 s (1.17x) | 3.25 s (1.97x) | 6.39 s | 0 bytes in 3.13 ms / 1.33 GiB in 991 ms | "
         "692 MiB / 2.02 GiB | 0 bytes / 4.88 GiB | 2.38 GiB / 8.10 GiB |"),
    )]
    assert (repo_copy / "README.md").read_text() == (REPO / "README.md").read_text()
    assert tables.main(["--check", "--root", str(repo_copy)]) == 0


def test_a_figure_quoted_in_both_readmes_changes_in_both(repo_copy):
    def smaller_logprob_peak(row):
        if row.get("case", "").startswith("vocab 151936"):
            row["peak_bytes"], row["memory_ratio"] = 2**29, row["baseline_peak_bytes"] / 2**29

    edit_rows(repo_copy / "bench" / "results" / tables.LOGPROB_FULL, smaller_logprob_peak)
    assert tables.main(["--root", str(repo_copy)]) == 0
    assert "| 151936 | 512 MiB | 9.52 GiB | 19.0x | 5.17 GiB |" in (repo_copy / "bench" / "README.md").read_text()
    headline = ("| log-probabilities + loss + backward, vocab 151936 | 512 MiB | 9.52 GiB, all logits at once "
                "(19.0x less) |")
    assert headline in (repo_copy / "README.md").read_text()


def test_a_caption_names_the_commit_its_file_records(repo_copy):
    path = repo_copy / "bench" / "results" / tables.LORA_FULL
    result = json.loads(path.read_text())
    result["machine"]["source"] = {"commit": "0123456789abcdef", "dirty": True, "changed_files": ["x.py"]}
    path.write_text(json.dumps(result))
    assert tables.main(["--root", str(repo_copy)]) == 0
    words = " ".join((repo_copy / "bench" / "README.md").read_text().split())  # captions are wrapped
    assert "`cpu-lora-full.json` (AVX-512 with BF16, no AMX; commit 0123456 with uncommitted changes;" in words


def test_missing_or_unknown_blocks_and_renamed_rows_are_errors(repo_copy, capsys):
    readme = repo_copy / "bench" / "README.md"
    original = readme.read_text()
    readme.write_text(original.replace("tables: lora -->", "tables: nonesuch -->"))
    assert tables.main(["--check", "--root", str(repo_copy)]) == 2
    err = capsys.readouterr().err
    assert "no such table: nonesuch" in err and "missing: lora" in err

    readme.write_text(original)

    def renamed(row):
        if row.get("case") == "LoRA step qwen2-trl-0.36B: colo.grpo scheduler":
            row["case"] = "LoRA step qwen2-trl-0.36B: something else"

    edit_rows(repo_copy / "bench" / "results" / tables.LORA_FULL, renamed)
    assert tables.main(["--check", "--root", str(repo_copy)]) == 2
    assert "0 lora rows match" in capsys.readouterr().err


def test_regenerate_reports_every_block_problem():
    results = tables.Results(REPO / "bench" / "results")
    text = tables.block("lora", "") + "\n" + tables.block("lora", "") + "\n" + tables.block("nonesuch", "")
    with pytest.raises(ValueError) as raised:
        tables.regenerate(text, results, expected=("lora", "overlap"))
    assert str(raised.value) == ("generated blocks: no such table: nonesuch; more than once: lora; "
                                 "missing: overlap")


@pytest.mark.parametrize("value, text", [(1.0026, "1.00"), (17.948, "17.9"), (984.24, "984"), (0.45901, "0.459"),
                                         (9.996, "10.0"), (1544.47, "1544")])
def test_significant_keeps_three_figures_and_trailing_zeros(value, text):
    assert tables.significant(value) == text


def test_units():
    assert (tables.seconds(0.0079), tables.seconds(17.665)) == ("7.90 ms", "17.7 s")
    assert (tables.size(0), tables.size(1446400), tables.size(10219196416)) == ("0 bytes", "1.38 MiB", "9.52 GiB")
    assert (tables.ratio(0.8141), tables.ratio(8.92), tables.ratio(15.87)) == ("0.81x", "8.92x", "15.9x")
    assert (tables.count(361600), tables.count(17181696), tables.count(358356864)) == ("362K", "17.2M", "358M")
