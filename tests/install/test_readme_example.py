"""The README's GRPO example on SmolLM2, run as written (read from the README: an edit there is what runs
here; tests/helpers/doc_examples.py says what each run must do), in the dtype `--dtype auto` picks. A user
on a bf16 machine gets bf16 here; the test is marked cpu_kind, so .ci/run runs it again as the kinds this
machine is not (fp32 there)."""
from __future__ import annotations

import pytest
from helpers.doc_examples import REPO, bash_block, check_run, cut_to_fit, run_as_written

pytestmark = pytest.mark.slow


@pytest.mark.cpu_kind
def test_the_readme_grpo_example_runs_as_written(tmp_path, smollm2_model_dir):
    commands = cut_to_fit(bash_block(REPO / "README.md", "### GRPO on a real model"))
    assert "python -m colo.grpo --model $(python -m colo.smollm2)" in commands and "--dtype" not in commands
    check_run(run_as_written(commands, tmp_path), tmp_path, "LlamaForCausalLM")
    assert (tmp_path / "curve.png").stat().st_size > 10_000   # colo.grpo.plot's curve
