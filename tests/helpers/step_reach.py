"""`python tests/helpers/step_reach.py`: how far one serial GRPO step reaches, for reading it: the lines of
GRPOScheduler.train_step and the colo files whose Python functions run during a step (the toy task on a toy
model, fp32, serial steps; the step after the first, so nothing of set-up counts). Run it on two commits
to compare a redesign."""
from __future__ import annotations

import inspect
import sys
import tempfile
import threading
from pathlib import Path

import colo
from colo.grpo import GRPOConfig, GRPOScheduler, build_toy_model
from colo.grpo.toy_task import long_tail_toy_task


def main() -> int:
    root = Path(colo.__file__).parent
    reached: set[str] = set()

    def called(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(root)):
            reached.add(str(Path(frame.f_code.co_filename).relative_to(root)))

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(prompts_per_step=2, num_generations=2, max_new_tokens=8, save_every=0, overlap="off",
                            dtype="fp32")
        run = GRPOScheduler(build_toy_model(Path(tmp) / "model"), config=config,
                            task=long_tail_toy_task(mean_length=4), engine_options=dict(enforce_eager=True))
        try:
            run.train_step()
            threading.setprofile(called)
            sys.setprofile(called)
            run.train_step()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            run.close()
    lines = inspect.getsource(GRPOScheduler.train_step).count("\n")
    print(f"train_step: {lines} lines; one serial step runs code in {len(reached)} colo files:")
    print(" ".join(sorted(reached)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
