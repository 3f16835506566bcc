"""Experiment trackers for `python -m colo.grpo --report-to ...`: the step records that go to the
JSON-lines log also go to TensorBoard, Weights & Biases and/or Trackio, through each library's own
writer, with the run's config.

The names are TRL's (`report_to`): "tensorboard", "wandb", "trackio", "none", and "all" for every
one of the three that is installed. Each library is imported only when a run opens its writer, so
`check_report_to` (called before any engine starts) costs an importability check, no import.

Where each writes:
  tensorboard  LOG_DIR/runs/RUN_NAME (`tensorboard --logdir LOG_DIR/runs`); the config as text.
  wandb        project $WANDB_PROJECT (default "colo"); local files in $WANDB_DIR, else LOG_DIR.
               W&B's own environment applies: WANDB_MODE=offline keeps the run local
               (`wandb sync` uploads it later), WANDB_ENTITY, WANDB_API_KEY, ...
  trackio      project $TRACKIO_PROJECT (default "colo") in trackio's local store, $TRACKIO_DIR
               (default ~/.cache/huggingface/trackio; `trackio show` opens it); TRACKIO_SPACE_ID
               or TRACKIO_SERVER_URL send it to a Hugging Face Space or a self-hosted server.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from .completions_log import markdown_table

TRACKERS = ("tensorboard", "wandb", "trackio")
# What to install for each: the pip extra of colo that brings the tracker's package.
EXTRAS = {"tensorboard": "colo[tensorboard]", "wandb": "colo[wandb]", "trackio": "colo[trackio]"}
# The module whose presence means the tracker can run. TensorBoard's writer is torch's
# (torch.utils.tensorboard), which needs only the `tensorboard` package beside torch.
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(_MODULES[name]) is not None


def check_report_to(names: list[str] | None) -> tuple[str, ...]:
    """The trackers `--report-to` asks for, in order and each once; () for none.

    `names` are the flag's values (repeatable). "none" alone means no tracker. "all" alone means
    every installed tracker, as in TRL, but it is an error when none is installed: a run that
    asked to be tracked should not run untracked without a word. A named tracker whose package
    is missing is an error naming the extra to install, raised now rather than after the engine
    has spent minutes starting."""
    names = list(names or [])
    if not names:
        return ()
    for special in ("none", "all"):
        if special in names and len(names) > 1:
            raise ValueError(f"--report-to {special} cannot be combined with other trackers (got {' '.join(names)})")
    if names == ["none"]:
        return ()
    if names == ["all"]:
        found = tuple(name for name in TRACKERS if _installed(name))
        if not found:
            raise ValueError("--report-to all: none of " + ", ".join(TRACKERS) + " is installed; pip install "
                             + " or ".join(f"'{EXTRAS[name]}'" for name in TRACKERS))
        return found
    chosen = []
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"--report-to {name}: unknown tracker; choose from {', '.join(TRACKERS)}, all or none")
        if not _installed(name):
            raise ValueError(f"--report-to {name}: the {_MODULES[name]} package is not installed; "
                             f"pip install '{EXTRAS[name]}'")
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen)


def scalars(record: dict, prefix: str = "") -> dict[str, float | int]:
    """The numbers of a step record, nested dicts flattened to "outer/inner" keys. Bools become 0/1
    (a curve of when --overlap was on); strings, None and lists have no curve, so they are skipped."""
    out = {}
    for key, value in record.items():
        key = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, prefix=f"{key}/"))
        elif isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, (int, float)):
            out[key] = value
    return out


class Trackers:
    """The open writers of one run: `log(record)` after each step, `close()` at the end (also as a
    context manager). Open it on the main rank only: every tracker would count each rank as a run."""

    def __init__(self, names, *, run_name: str, config: dict, log_dir: Path, resumed_after: int | None = None):
        """resumed_after: the checkpoint's step when a run resumes; TensorBoard drops the events the
        stopped run logged after it (those steps are trained again)."""
        self.names = check_report_to(names)
        self.resumed_after = resumed_after
        # Plain JSON once for all three: the config may hold Paths or other objects that each library
        # would render (or reject) its own way.
        config = json.loads(json.dumps(config, default=str))
        log_dir = Path(log_dir)
        self._writers = []  # (log(step, metrics), close()) per tracker, in the order asked for
        try:
            for name in self.names:
                self._writers.append(getattr(self, f"_open_{name}")(run_name, config, log_dir, resumed_after))
        except BaseException:
            self.close()  # the writers already open: a failed start leaves no run half-open
            raise

    @staticmethod
    def _open_tensorboard(run_name: str, config: dict, log_dir: Path, resumed_after: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resumed_after is None else resumed_after + 1
        writer = SummaryWriter(log_dir=str(log_dir / "runs" / run_name), purge_step=purge)
        # A fenced block: TensorBoard's text tab renders Markdown, which would reflow bare JSON.
        writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```")

        def log(step, metrics):
            for key, value in metrics.items():
                writer.add_scalar(key, value, global_step=step)

        log.completions = lambda step, samples: writer.add_text("completions", markdown_table(samples), global_step=step)
        return log, writer.close  # close() flushes first; a second close() is a no-op

    @staticmethod
    def _open_wandb(run_name: str, config: dict, log_dir: Path, resumed_after: int | None):
        import wandb

        # The run object rather than wandb.log/wandb.finish: they act on whatever run is current
        # in the process, and this one is ours. dir= would override WANDB_DIR, so it is passed on.
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "colo"), name=run_name, config=config,
                         dir=os.environ.get("WANDB_DIR") or str(log_dir))
        def log(step, metrics):
            run.log(metrics, step=step)

        def completions(step, samples):
            columns = ["step", "prompt", "completion", *samples[0]["rewards"], "reward", "advantage"]
            rows = [[s["step"], str(s["prompt"]), str(s["completion"]), *s["rewards"].values(), s["reward"],
                     s["advantage"]] for s in samples]
            run.log({"completions": wandb.Table(columns=columns, data=rows)}, step=step)

        log.completions = completions
        return log, run.finish

    @staticmethod
    def _open_trackio(run_name: str, config: dict, log_dir: Path, resumed_after: int | None):
        import trackio

        # trackio keeps its own store ($TRACKIO_DIR), not LOG_DIR: its dashboard shows a project's
        # runs from there. init() makes this run trackio's current one, which trackio.log and
        # trackio.finish act on; finish() also clears it, so trackio's exit hook does not finish
        # the run a second time (run.finish() alone would leave it current).
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "colo"), name=run_name, config=config)
        return (lambda step, metrics: trackio.log(metrics, step=step)), trackio.finish

    def log(self, record: dict) -> None:
        """Send a step record's numbers at step record["step"] (the step itself is the x axis)."""
        step = record["step"]
        metrics = scalars({key: value for key, value in record.items() if key != "step"})
        for log, _ in self._writers:
            log(step, metrics)

    def log_completions(self, step: int, samples: list[dict]) -> None:
        """A step's sampled completions (colo.grpo.completions_log) to the trackers that show tables."""
        for log, _ in self._writers:
            if samples and hasattr(log, "completions"):
                log.completions(step, samples)

    def close(self) -> None:
        """Flush and finish every writer, each even if another fails; a second call does nothing."""
        writers, self._writers = self._writers, []
        failure = None
        for _, close in writers:
            try:
                close()
            except Exception as e:  # finish the others first, then report the first failure
                failure = failure or e
        if failure is not None:
            raise failure

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
