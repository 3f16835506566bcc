"""`python -m colo.grpo.plot log.jsonl -o curve.png`: a run's learning curve from its step log.

`python -m colo.grpo.plot a.jsonl b.jsonl --labels bf16 fp32 -o compare.png`: several runs side by side,
their reward per step (a 5-step running mean over the raw values) with their eval pass@1 points, and
their seconds per step.

Top: the reward per step (mean, with the std as a band) and each reward function's mean, with the
eval pass@1 points where the run evaluated. Then completion length per step (mean, min-max band) and
the share of completions cut by max_new_tokens (clipped_ratio, right axis). An agentic run (tools,
colo.grpo.agent) gets a third panel: the share of rollouts that called a tool, tool calls per
rollout, and assistant turns per rollout (right axis).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    """The step records of a JSON-lines log (a half-written last line of a killed run is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no step records")
    return records


def plot(records: list[dict], out: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = records
    records = [r for r in records if "reward_mean" in r]  # the steps; an eval before the first (step 0) has none
    if not records:
        raise ValueError("the log holds no training step")
    steps = [r["step"] for r in records]
    agentic = "tools/rollouts_calling" in records[0]
    fig, axes = plt.subplots(3 if agentic else 2, 1, figsize=(8, 10 if agentic else 7), sharex=True)
    top, bottom = axes[0], axes[1]
    mean = [r["reward_mean"] for r in records]
    std = [r.get("reward_std", 0.0) for r in records]
    top.plot(steps, mean, color="black", label="reward (weighted sum)")
    top.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                     color="black", alpha=0.1)
    functions = sorted({k.split("/")[1] for r in records for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    if len(functions) > 1:
        for name in functions:
            top.plot(steps, [r.get(f"rewards/{name}/mean") for r in records], label=name, alpha=0.8)
    for key in sorted({k for r in evaluated for k in r if k.startswith("eval/")}):
        points = [(r["step"], r[key]) for r in evaluated if key in r]
        top.plot(*zip(*points), "o--", label=f"{key} (greedy pass@1)")
    top.set_ylabel("reward")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    if "completion_length_mean" in records[0]:
        bottom.plot(steps, [r["completion_length_mean"] for r in records], color="tab:blue", label="completion tokens")
        bottom.fill_between(steps, [r["completion_length_min"] for r in records],
                            [r["completion_length_max"] for r in records], color="tab:blue", alpha=0.15)
        clipped = bottom.twinx()
        clipped.plot(steps, [r["clipped_ratio"] for r in records], color="tab:red", label="clipped ratio")
        clipped.set_ylim(-0.02, 1.02)
        clipped.set_ylabel("clipped ratio", color="tab:red")
    else:
        bottom.plot(steps, [r["tokens_generated"] for r in records], label="tokens generated")
    bottom.set_ylabel("completion tokens", color="tab:blue")
    bottom.grid(alpha=0.3)
    if agentic:
        tools = axes[2]
        tools.plot(steps, [r["tools/rollouts_calling"] for r in records], color="tab:green",
                   label="rollouts that called a tool")
        tools.plot(steps, [r["tools/call_frequency"] for r in records], color="tab:olive", label="tool calls per rollout")
        tools.set_ylabel("share / calls")
        tools.legend(fontsize=8, loc="upper left")
        tools.grid(alpha=0.3)
        turns = tools.twinx()
        turns.plot(steps, [r["turns_mean"] for r in records], color="tab:purple", label="turns per rollout")
        turns.set_ylabel("turns per rollout", color="tab:purple")
    axes[-1].set_xlabel("step")
    return _saved(fig, out, title)


def _saved(fig, out: str | Path, title: str | None) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title or "colo.grpo")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def compare(runs: dict[str, list[dict]], out: str | Path, title: str | None = None) -> Path:
    """Runs' step logs ({label: records}) on one figure: reward and eval pass@1, then seconds per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for (label, records), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4):
        steps = [r for r in records if "reward_mean" in r]
        x, reward = [r["step"] for r in steps], [r["reward_mean"] for r in steps]
        running = [sum(reward[max(0, i - 4):i + 1]) / len(reward[max(0, i - 4):i + 1]) for i in range(len(reward))]
        top.plot(x, reward, color=color, alpha=0.25)
        top.plot(x, running, color=color, label=f"{label}: reward (5-step mean)")
        for key in sorted({k for r in records for k in r if k.startswith("eval/")}):
            points = [(r["step"], r[key]) for r in records if key in r]
            top.plot(*zip(*points), "o--", color=color, label=f"{label}: {key} (greedy pass@1)")
        bottom.plot(x, [r["step_s"] for r in steps], color=color, label=label)
    top.set_ylabel("reward")
    top.legend(fontsize=7)
    top.grid(alpha=0.3)
    bottom.set_ylabel("seconds per step")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    return _saved(fig, out, title)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colo.grpo.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", nargs="+", help="the step log of a run (--json); several: compared")
    parser.add_argument("--labels", nargs="+", help="one label per log (default: the file names)")
    parser.add_argument("-o", "--out", default="curve.png", help="PNG to write (default %(default)s)")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(log).stem for log in args.log]
    if len(labels) != len(args.log):
        parser.error(f"--labels: {len(labels)} labels for {len(args.log)} logs")
    try:
        runs = {label: read_log(log) for label, log in zip(labels, args.log)}
        print(plot(runs[labels[0]], args.out, args.title) if len(runs) == 1 else compare(runs, args.out, args.title))
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"{' '.join(args.log)}: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
