"""The table of colo.grpo's settings in docs/grpo.md, made from GRPOConfig's fields (colo.grpo.settings):
`python -m colo.grpo.settings_docs` prints it, `--write` puts it between its markers in docs/grpo.md."""
from __future__ import annotations

import argparse

from .config import GRPOConfig
from .settings import docs_table

TABLE_BEGIN = "<!-- settings: made by python -m colo.grpo.settings_docs --write; edit colo/grpo/config.py instead -->"
TABLE_END = "<!-- end of settings -->"


def docs_with_table(text: str, table: str) -> str:
    """docs/grpo.md's text with the table between its markers replaced by `table`."""
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    return text[:begin] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> None:
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m colo.grpo.settings_docs",
                                     description="Print (or --write into docs/grpo.md) the table of colo.grpo's settings.")
    parser.add_argument("--write", action="store_true", help="rewrite docs/grpo.md's table")
    args = parser.parse_args(argv)
    table = docs_table(GRPOConfig)
    if not args.write:
        print(table, end="")
        return
    path = Path(__file__).resolve().parents[2] / "docs" / "grpo.md"
    path.write_text(docs_with_table(path.read_text(), table))
    print(f"wrote the settings' table into {path}")


if __name__ == "__main__":
    main()
