"""docs/families.md's Gemma 3 270M example, run as written (read from the doc; tests/helpers/doc_examples.py
says what each run must do), in the dtype `--dtype auto` picks."""
from __future__ import annotations

import pytest
from helpers.doc_examples import REPO, bash_block, check_run, cut_to_fit, run_as_written

pytestmark = pytest.mark.slow


def test_the_gemma3_example_runs_as_written(tmp_path, gemma3_model_dir):
    commands = cut_to_fit(bash_block(REPO / "docs" / "families.md", "## A second real model: Gemma 3 270M"))
    assert "python -m colo.grpo --model $(python -m colo.gemma3)" in commands and "--dtype" not in commands
    records = check_run(run_as_written(commands, tmp_path), tmp_path, "Gemma3ForCausalLM")
    assert records[0]["step"] == 0 and "eval/first_number" in records[0]   # --eval-on-start
