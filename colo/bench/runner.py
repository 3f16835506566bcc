"""Runs benchmark sections, prints each row as it is measured, and writes the results file.

A section that is missing or cannot be imported yields a row whose `note` says so; a section that
raises while running yields a row with the error and makes the run exit non-zero, after every
other section has still run and the JSON has been written.
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import shlex
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from ..console import LogsToFile
from . import ABOUT, FRESH_PROCESS_SECTIONS, SECTION_MODULES, SECTIONS, UNTIMED_SETUP_SECTIONS
from .machine import describe, machine_info

STANDARD_KEYS = ("section", "case", "device", "colo_s", "baseline", "baseline_s", "ratio", "note")
# A row whose figures are not times gives them as colo_figure and baseline_figure in figure_unit; a row
# with in_summary=False (a baseline other rows compare against) is left out of the closing table.


def devices_for(choice: str) -> tuple[str, ...]:
    return ("cpu", "cuda") if choice == "all" else (choice,)


def make_progress(section: str, stream=None):
    """The `progress(iterable, desc)` callable handed to sections: a tqdm bar on a terminal; elsewhere
    (a log file, CI) a line on `stream` (default stderr) as each item starts, so a long section still
    shows it is alive."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return lambda iterable, desc="", **kw: _progress_lines(section, iterable, desc, stream)
    try:
        from tqdm import tqdm
    except ImportError:  # a bar is a convenience, never a reason to fail
        return lambda iterable, desc="", **kw: iterable

    def progress(iterable, desc="", **kw):
        # disable=None: a bar on a terminal only; in a log file it would be a wall of carriage returns.
        return tqdm(iterable, desc=f"{section}: {desc}", leave=False, file=stream, dynamic_ncols=True,
                    disable=None, **kw)

    return progress


def _progress_lines(section: str, iterable, desc: str, stream):
    items = list(iterable)
    started = time.perf_counter()
    for i, item in enumerate(items):
        print(f"[colo.bench]   {section}: {desc} {i + 1}/{len(items)} ({time.perf_counter() - started:.0f} s in)",
              file=stream, flush=True)
        yield item


def load_section(name: str):
    """(module, '') or (None, why it cannot run)."""
    module_name = f"{__package__}.{SECTION_MODULES.get(name, name)}"
    try:
        return importlib.import_module(module_name), ""
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None, f"section not available: module {module_name} does not exist yet"
        return None, f"section could not be imported: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - any import failure becomes a row, not a crash
        return None, f"section could not be imported: {type(e).__name__}: {e}"


def run_section(name: str, quick: bool, devices: tuple[str, ...], progress=None) -> tuple[list[dict], bool]:
    """Rows of one section and whether it failed (raised while running)."""
    module, why = load_section(name)
    if module is None:
        return [{"section": name, "case": "(section)", "note": why}], False
    progress = progress or make_progress(name)
    kwargs = {"quick": quick, "progress": progress}
    # Sections may take `devices` to skip work for devices not asked for; the rest are filtered below.
    takes_devices = "devices" in inspect.signature(module.run).parameters
    if takes_devices:
        kwargs["devices"] = devices
    try:
        rows = list(module.run(**kwargs))
    except Exception as e:  # noqa: BLE001
        last = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(last.filename).name}:{last.lineno}"
        return [{"section": name, "case": "(section)", "note": f"failed: {type(e).__name__}: {e} ({where})"}], True
    for row in rows:
        row.setdefault("section", name)
        row.setdefault("case", "")
    if not takes_devices:
        rows = [r for r in rows if r.get("device") in (None, *devices)]
    if not rows:
        rows = [{"section": name, "case": "(section)", "note": f"no rows for device(s) {', '.join(devices)}"}]
    return rows, False


def _rough(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


# ---- printing ---------------------------------------------------------------------------------

def format_seconds(s) -> str:
    if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s):
        return "-"
    if s < 1e-6:
        return f"{s * 1e9:.0f} ns"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def format_value(key: str, value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if "bytes" in key:
        return f"{value / 2**20:.1f}MiB" if abs(value) >= 2**20 else f"{value:.0f}B"
    if key.endswith("_s"):
        return format_seconds(value)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


_COLUMNS = (("section", 10), ("case", 38), ("device", 6), ("colo", 12), ("baseline", 36), ("baseline", 12),
            ("ratio", 8))


def figure(row: dict, side: str) -> str:
    """A row's figure for `side` ("colo" or "baseline"): its time, or its figure in its unit."""
    value = row.get(f"{side}_figure")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.2f} {row.get('figure_unit', '')}".rstrip()
    return format_seconds(row.get(f"{side}_s"))


def header(details: bool = True) -> str:
    return " ".join(f"{title:<{width}}" for title, width in _COLUMNS) + (" details" if details else "")


def summary_table(rows: list[dict]) -> str:
    """One line per row, section, what, colo, baseline, ratio: the end of a run, on one screen."""
    def cut(text, width):
        text = str(text or "")
        return text if len(text) <= width else text[:width - 1] + "…"

    lines = [f"{'section':<14} {'what':<40} {'colo':>12} {'baseline':<28} {'':>12} {'ratio':>7}"]
    for row in rows:
        if row.get("device") == "cuda" and row.get("colo_s") is None:
            continue  # a device that did not run (its row in the JSON says why)
        if row.get("in_summary") is False:
            continue
        ratio = row.get("ratio")
        lines.append(f"{cut(row.get('section'), 14):<14} {cut(row.get('case'), 40):<40} "
                     f"{figure(row, 'colo'):>12} {cut(row.get('baseline'), 28):<28} "
                     f"{figure(row, 'baseline'):>12} "
                     f"{(f'{ratio:.2f}x' if isinstance(ratio, (int, float)) and math.isfinite(ratio) else '-'):>7}")
    return "\n".join(lines)


def format_row(row: dict, details: bool = True) -> str:
    ratio = row.get("ratio")
    cells = (
        row.get("section", ""), row.get("case", ""), row.get("device", ""),
        figure(row, "colo"), row.get("baseline", "") or "", figure(row, "baseline"),
        f"{ratio:.2f}x" if isinstance(ratio, (int, float)) and math.isfinite(ratio) else "-",
    )
    text = " ".join(f"{str(cell):<{width}}" for cell, (_, width) in zip(cells, _COLUMNS))
    if not details:
        return text + (f" ({row['note'][:80]})" if str(row.get("note", "")).startswith("failed") else "")
    details = [f"{k}={format_value(k, v)}" for k, v in row.items() if k not in STANDARD_KEYS]
    if row.get("note"):
        details.append(f"note: {row['note']}")
    return text + " " + " ".join(details)


# ---- results file -----------------------------------------------------------------------------

def _json_safe(value):
    """NaN/inf are not JSON; write them as null rather than produce a file other tools reject."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_json_safe(result), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)  # never leave a half-written results file


def colo_build_info() -> dict:
    try:
        import colo

        return colo.build_info()
    except Exception as e:  # noqa: BLE001 - recorded, not fatal: the pool sections will say why they skipped
        return {"error": f"{type(e).__name__}: {e}"}


def run(sections: list[str], quick: bool, device: str, argv: list[str], json_path: Path | None = None,
        out=sys.stdout, logs: Path | None = None) -> tuple[dict, bool]:
    """Run `sections` in order; returns (result, any_section_failed). logs: where the sections' own
    output goes (None: to the terminal); each row is printed as it is measured, details in the JSON."""
    from colo.engine import quiet_vllm_logs

    from .measure import start_fresh_processes, wait_for_started_processes

    quiet_vllm_logs()  # stdout carries only the table
    info = machine_info()
    result = {
        "command": shlex.join(["python", "-m", "colo.bench", *argv]),
        "python_executable": sys.executable,
        "cwd": os.getcwd(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "quick": quick,
        "device": device,
        "sections": list(sections),
        "machine": info,
        "build_info": colo_build_info(),
        "section_seconds": {},
        "rows": [],
    }
    print(f"# {describe(info)}", file=out)
    print(f"# {'quick' if quick else 'full'} run, device(s): {device}; ratio = baseline / colo (>1: colo faster)",
          file=out)
    if logs is not None:
        print(f"# vLLM's and torch's logs go to {logs} (--show-logs prints them here)", file=out)
    print(header(details=logs is None), file=out, flush=True)
    redirect = LogsToFile(logs, colo_warnings=False)
    compile_ahead = fresh_process_plan(sections, quick)
    failed = False
    started = time.perf_counter()
    for number, name in enumerate(sections, 1):
        about, quick_s, full_s = ABOUT.get(name, ("", None, None))
        took = quick_s if quick else full_s
        print(f"[colo.bench] {number}/{len(sections)} {name}: {about}" + (f" (about {_rough(took)} on 2 CPU cores)"
              if took else ""), file=redirect.err, flush=True)
        t0 = time.perf_counter()
        with redirect:
            # (its per-item progress lines go where its logs go; the fork server's output too)
            if name in compile_ahead:
                start_fresh_processes(compile_ahead[name])  # runs while the section builds its engines
            rows, section_failed = run_section(name, quick, devices_for(device))
            wait_for_started_processes()  # nothing of it shares the machine with the next section
        failed |= section_failed
        result["section_seconds"][name] = round(time.perf_counter() - t0, 3)
        result["rows"].extend(rows)
        for row in rows:
            print(format_row(row, details=logs is None), file=out, flush=True)
        if json_path is not None:
            write_json(result, json_path)  # after every section, so a crash later keeps what was measured
    result["total_seconds"] = round(time.perf_counter() - started, 3)
    if json_path is not None:
        write_json(result, json_path)
    return result, failed


def fresh_process_plan(sections: list[str], quick: bool) -> dict[str, list]:
    """{section: the compile-ahead functions to start in fresh processes as it begins}, for the sections
    with an untimed set-up (colo.bench.UNTIMED_SETUP_SECTIONS: they build models and engines before they
    time anything, and wait for what was started before they do). The first of them starts the fork server
    of the fresh processes when a later section runs fresh processes; in a quick run each starts the
    COMPILE_AHEAD functions of the sections that follow it, up to and including the next one: they build
    those sections' engines so that a fresh machine compiles them beside this set-up, on the core its own
    compiling leaves idle, instead of one after another."""
    setups = [i for i, name in enumerate(sections) if name in UNTIMED_SETUP_SECTIONS]
    plan = {}
    # A full run compiles each section's engines in that section: none of the later modules is imported here.
    for number, i in enumerate(setups if quick else ()):
        until = setups[number + 1] + 1 if number + 1 < len(setups) else len(sections)
        ahead = [fn for name in sections[i + 1:until] for fn in getattr(load_section(name)[0], "COMPILE_AHEAD", ())]
        if ahead:
            plan[sections[i]] = ahead
    if setups and any(name in FRESH_PROCESS_SECTIONS for name in sections[setups[0] + 1:]):
        plan.setdefault(sections[setups[0]], [])
    return plan


def source_commit() -> str | None:
    """The git commit of colo's source (with "+changes" when the work tree differs from it), or None
    outside a git checkout: what a results file was measured with."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if dirty else "")


__all__ = ["SECTIONS", "run", "run_section", "load_section", "write_json", "format_row", "devices_for"]
