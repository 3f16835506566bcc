"""`--plot PATH`: one PNG of a results file.

Panels: publish time against model size (params) for colo and each baseline, log-log; the GRPO
step breakdown as stacked bars, colo beside the usual way; and every row's ratio, so the pool
sections appear too. A panel whose section did not run says so instead of failing.

GRPO rows are stacked from their phase keys: `colo_<phase>_s` and `baseline_<phase>_s`
(for example colo_generate_s, colo_train_s, colo_publish_s); whatever the phases leave of the
row's total (`colo_s`, `baseline_s`) is drawn as "other".
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

PHASE_ORDER = ("generate", "reward", "rewards", "train", "publish", "phase_switch", "sleep", "wake")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _rows(result: dict, section: str) -> list[dict]:
    return [r for r in result.get("rows", []) if r.get("section") == section]


def _notes(rows: list[dict]) -> str:
    return "; ".join(sorted({r["note"] for r in rows if r.get("note")}))


def _say(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def publish_series(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """{label: [(params, seconds), ...]} for colo and each baseline, per device."""
    points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        params = _number(r.get("params"))
        if not params or params <= 0:
            continue
        device = r.get("device", "")
        for label, seconds in ((f"colo ({device})", r.get("colo_s")),
                               (f"{r.get('baseline', 'baseline')} ({device})", r.get("baseline_s"))):
            seconds = _number(seconds)
            if seconds and seconds > 0:  # a log axis cannot show zero
                points[label][params].append(seconds)
    return {label: sorted((p, sum(s) / len(s)) for p, s in by_params.items()) for label, by_params in points.items()}


def plot_publish(ax, result: dict) -> None:
    rows = _rows(result, "publish")
    series = publish_series(rows)
    if not series:
        _say(ax, "publish: no timed rows" + (f"\n({_notes(rows)})" if rows else " (section not run)"))
        ax.set_title("Weight publish")
        return
    for label, pts in sorted(series.items(), key=lambda item: not item[0].startswith("colo")):
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", linewidth=2.5 if label.startswith("colo") else 1.5, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model size (parameters)")
    ax.set_ylabel("seconds per publish")
    ax.set_title("Weight publish: engine sees new weights")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def phases(row: dict, side: str) -> dict[str, float]:
    pattern = re.compile(rf"^{side}_(\w+)_s$")
    found = {m.group(1): _number(v) for k, v in row.items() if (m := pattern.match(k))}
    found = {k: v for k, v in found.items() if v is not None and v >= 0}
    order = {name: i for i, name in enumerate(PHASE_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def plot_grpo(ax, result: dict) -> None:
    rows = [r for r in _rows(result, "grpo_step") if _number(r.get("colo_s")) or _number(r.get("baseline_s"))]
    if not rows:
        all_rows = _rows(result, "grpo_step")
        _say(ax, "GRPO step: no timed rows" + (f"\n({_notes(all_rows)})" if all_rows else " (section not run)"))
        ax.set_title("GRPO step breakdown")
        return
    bars = []  # (label, {phase: seconds})
    baselines = sorted({str(r.get("baseline", "baseline")) for r in rows})
    for r in rows:
        prefix = f"{r.get('model') or r.get('case', '')} {r.get('dtype', '')} [{r.get('device', '')}]\n"
        for side, label in (("colo", "colo"), ("baseline", "usual")):
            total = _number(r.get(f"{side}_s"))
            parts = phases(r, side)
            if total is None and not parts:
                continue
            rest = (total or 0.0) - sum(parts.values())
            if rest > 1e-3 * (total or 1.0):
                parts["other"] = rest
            bars.append((prefix + str(label), parts))
    names = list(dict.fromkeys(p for _, parts in bars for p in parts))
    colors = dict(zip(names, [f"C{i}" for i in range(len(names))]))
    labelled = set()  # one legend entry per phase
    for x, (_, parts) in enumerate(bars):
        bottom = 0.0
        for name, seconds in parts.items():
            ax.bar(x, seconds, bottom=bottom, color=colors[name], label=None if name in labelled else name)
            labelled.add(name)
            bottom += seconds
        ax.text(x, bottom, f"{bottom:.3g} s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(f"GRPO step breakdown (usual: {'; '.join(baselines)})", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def plot_ratios(ax, result: dict) -> None:
    rows = [r for r in result.get("rows", []) if _number(r.get("ratio"))]
    if not rows:
        _say(ax, "no rows with a ratio")
        ax.set_title("colo vs baseline")
        return
    sections = list(dict.fromkeys(r["section"] for r in rows))
    ratios = [r["ratio"] for r in rows]
    ax.barh(range(len(rows)), ratios, color=[f"C{sections.index(r['section'])}" for r in rows], alpha=0.45)
    ax.set_xscale("log")
    ax.set_xlim(min(0.5, min(ratios) / 2), max(10.0, max(ratios)) * 2)
    ax.axvline(1.0, color="black", linewidth=1)
    # Labels inside the axes, not as tick labels: long ones would squeeze the panels above.
    label_at = ax.get_yaxis_transform()  # x in axes fraction, y in data
    for i, r in enumerate(rows):
        ax.text(0.005, i, f"{r['ratio']:.3g}x   {r['section']}: {r.get('case', '')} vs {r.get('baseline', '')} "
                f"[{r.get('device', '')}]", transform=label_at, va="center", fontsize=7)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("baseline time / colo time (>1: colo faster; black line: equal)")
    ax.set_title("Every comparison in this run")
    ax.grid(True, axis="x", which="major", alpha=0.3)


def write_plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on benchmark machines
    import matplotlib.pyplot as plt

    ratio_rows = sum(1 for r in result.get("rows", []) if _number(r.get("ratio")))
    ratio_height = max(4.0, 0.22 * ratio_rows)  # inches: keep the comparison labels legible
    fig = plt.figure(figsize=(16, 6 + ratio_height))
    grid = fig.add_gridspec(2, 2, height_ratios=[6, ratio_height])
    plot_publish(fig.add_subplot(grid[0, 0]), result)
    plot_grpo(fig.add_subplot(grid[0, 1]), result)
    plot_ratios(fig.add_subplot(grid[1, :]), result)
    machine = result.get("machine", {})
    gpus = ", ".join(g.get("name", "") for g in machine.get("gpus", [])) or "no GPU"
    fig.suptitle(f"colo.bench {'quick' if result.get('quick') else 'full'} run, {result.get('date', '')}: "
                 f"{machine.get('cpu_model', '?')}, {machine.get('cpus_usable', '?')} cores, {gpus}", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    # Re-plot a results file: python -m colo.bench.results_plot RESULTS.json OUT.png
    import json
    import sys

    if len(sys.argv) != 3 or not sys.argv[2].endswith(".png"):
        sys.exit("usage: python -m colo.bench.results_plot RESULTS.json OUT.png")
    write_plot(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
