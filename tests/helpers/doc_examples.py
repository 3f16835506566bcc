"""Running a doc's example commands as written (tests/install/test_readme_example.py and
test_gemma3_example.py): in the dtype `--dtype auto` picks on this machine, with only the step count cut
to one (and the evaluation moved to it) to fit CI. Each run must: exit 0 with colo's lines alone on the
terminal (vLLM's and torch's in OUT/logs.txt, what Triton prints at exit too), train in the picked dtype
with 0 bytes per publish and the engine's log-probabilities within rounding of the trainer's, and leave
OUT/final, which transformers loads."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The engine's mean gap to the trainer on the sampled tokens, by dtype (seen here: about 1e-5 in fp32,
# 0.03 to 0.06 in bf16 for SmolLM2 and Gemma 3 270M); a stale or mis-laid weight is O(1).
GAP = {"fp32": 1e-3, "bf16": 0.15}   # (the mean; tests/helpers/logprobs.py has both bounds)


def bash_block(doc: Path, heading: str) -> str:
    """The first ```bash block after `heading` in `doc`, continuation lines joined."""
    text = doc.read_text()
    start = text.index(heading)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)
    return block.replace("\\\n", " ")


def cut_to_fit(commands: str, steps: int = 1) -> str:
    """The commands as written but for the step count (`steps`) and the evaluation (every `steps` steps)."""
    commands = re.sub(r"--steps \d+", f"--steps {steps}", commands)
    return re.sub(r"--eval-every \d+", f"--eval-every {steps}", commands)


def run_as_written(commands: str, workdir: Path) -> subprocess.CompletedProcess:
    lines = [line for line in commands.splitlines() if line.strip() and not line.strip().startswith(". ")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)   # as in a user's shell
    return subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=1200)


def check_run(done: subprocess.CompletedProcess, workdir: Path, model_class: str) -> list[dict]:
    from colo.dtype_choice import fastest_dtype

    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    stdout, stderr = ([line for line in text.replace("\r", "\n").splitlines() if line.strip()]
                      for text in (done.stdout, done.stderr))
    ours = [line for line in stdout + stderr if line.startswith("colo.grpo")]   # (stderr: the progress bar)
    # colo's lines and the files the commands say they wrote (the data, the plot): no vLLM, torch or Triton
    # line (nanobind's leak report at exit included)
    others = [line for line in stdout + stderr if line not in ours and not re.fullmatch(r"[\w./-]+\.(jsonl|png)", line)]
    assert not others, others[:20]
    grpo = [line for line in stdout if line.startswith("colo.grpo")]
    assert grpo[-1].startswith("colo.grpo: steps 1-1 done"), grpo[-5:]
    assert any("engine: vLLM" in line for line in ours) and any("weights in" in line for line in ours)
    logs = (workdir / "ckpt" / "logs.txt").read_text()
    assert "Loading safetensors" in logs or "WARNING" in logs
    records = [json.loads(line) for line in (workdir / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1]
    dtype = fastest_dtype("cpu").name
    for r in steps:
        assert r["dtype"] == dtype and r["publish_bytes_copied"] == 0
        assert r["engine_logprob_mean_abs_diff"] < GAP[dtype], r
    assert any(key.startswith("eval/") for r in records for key in r)
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(workdir / "ckpt" / "final")
    assert type(loaded).__name__ == model_class
    return records

