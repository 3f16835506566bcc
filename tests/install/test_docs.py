"""The docs name files that exist: every `colo/...`, `tests/...`, `bench/...` path in README.md, docs/ and
bench/README.md (a moved module otherwise leaves a stale pointer behind)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATH = re.compile(r"`((?:colo|tests|bench|buildtools|csrc|docs)/[A-Za-z0-9_./-]+\.[a-z]+)`")


def test_every_path_the_docs_name_exists():
    docs = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {(doc.relative_to(REPO), match.group(1)) for doc in docs for match in PATH.finditer(doc.read_text())}
    assert len(named) > 30
    missing = sorted((str(doc), path) for doc, path in named if not (REPO / path).exists())
    assert not missing, missing
