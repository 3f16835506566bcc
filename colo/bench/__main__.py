"""`python -m colo.bench`: colo's microbenchmarks, each beside its baseline measured in the same run."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import DEVICE_CHOICES, QUICK_SECTIONS, SECTIONS


def parse_sections(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no section named; valid sections: {', '.join(SECTIONS)}")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown section(s): {', '.join(unknown)}; valid sections: {', '.join(SECTIONS)}")
    return list(dict.fromkeys(names))  # drop repeats, keep order


def png_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"--plot writes a PNG image; give a path ending in .png, not {text!r}")
    return path


def json_path(text: str) -> Path:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path for the JSON results")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m colo.bench",
        description="Measure colo against the baselines a user would otherwise use, in the same run, and report "
                    "ratios (baseline / colo; >1 means colo is faster). Sections: " + ", ".join(SECTIONS) + ".",
        epilog="Example: python -m colo.bench --quick --json bench/results/cpu-quick.json "
               "--plot bench/results/cpu-quick.png",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes, fewer repeats, no lora section: about 4 minutes on a 2-core CPU, 5 the "
                             "first time (vLLM compiles each model graph once per machine)")
    parser.add_argument("--json", type=json_path, metavar="PATH",
                        help="write rows, machine, exact command, date and colo build info to PATH")
    parser.add_argument("--plot", type=png_path, metavar="PATH",
                        help="write a PNG: publish time against model size, and the GRPO step breakdown")
    parser.add_argument("--sections", type=parse_sections, metavar="A,B",
                        help=f"comma-separated sections to run (default: all of {','.join(SECTIONS)}; with --quick "
                             f"{','.join(QUICK_SECTIONS)})")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where the results (results.json), the plot (results.png) and vLLM's and torch's logs "
                             "(logs.txt) go (default: --json's directory, else bench-out/<UTC date-time>); --json and "
                             "--plot name other paths")
    parser.add_argument("--show-logs", action="store_true",
                        help="print vLLM's and torch's logs and every row's details here instead of into the logs file")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="all",
                        help="which device rows to run; 'all' (default) runs CPU and adds CUDA rows, or notes why "
                             "CUDA could not run")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    from . import runner  # imported after parsing so that --help never touches torch or colo._C

    sections = args.sections or list(QUICK_SECTIONS if args.quick else SECTIONS)
    if args.out is None and args.json is not None:
        args.out = args.json.parent   # the logs beside the results asked for
    if args.out is None:
        from datetime import datetime, timezone

        args.out = Path("bench-out") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.json = args.json or args.out / "results.json"
    args.plot = args.plot or args.out / "results.png"
    logs = None if args.show_logs else args.out / "logs.txt"
    result, failed = runner.run(sections, args.quick, args.device, argv, json_path=args.json, logs=logs)
    print("\n" + runner.summary_table(result["rows"]))
    print(f"\nresults: {args.json}" + (f"\nlogs: {logs}" if logs is not None else ""))
    if args.plot:
        import json

        from . import results_plot as plot

        try:
            # Plot from the file when there is one, so a plot is always of exactly what was recorded.
            if args.json:
                result = json.loads(args.json.read_text())
            plot.write_plot(result, args.plot)
        except Exception as e:  # noqa: BLE001
            print(f"[colo.bench] could not write the plot {args.plot}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(f"plot: {args.plot}")
    if failed:
        print("[colo.bench] at least one section failed; see the rows whose note starts with 'failed:'",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
