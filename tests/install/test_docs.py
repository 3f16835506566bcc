"""The docs name files and modules that exist: every `colo/...`, `tests/...`, `bench/...` path in
README.md, docs/ and bench/README.md, in backticks, links or prose, and every dotted `colo.x.y` name
(a module, or a name a module defines), so a moved or renamed module leaves no stale pointer behind."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A path starts the word (or follows a link's ../) and ends in a file extension.
PATH = re.compile(r"(?<![\w/.-])(?:\.\./)*"
                  r"((?:colo|tests|bench|buildtools|csrc|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_]\.[a-z]+)\b")
DOTTED = re.compile(r"(?<![\w./-])colo(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
COMPILED = {"colo._C"}  # the extension setup.py builds


def named(pattern) -> set[tuple[str, str]]:
    return {(str(doc.relative_to(REPO)), match.group(1) if pattern.groups else match.group(0))
            for doc in DOCS for match in pattern.finditer(doc.read_text())}


def test_every_path_the_docs_name_exists():
    paths = named(PATH)
    assert len(paths) > 100
    missing = sorted((doc, path) for doc, path in paths if not (REPO / path).exists())
    assert not missing, missing


def defined_in(source: str, name: str) -> bool:
    """Whether a module's source defines or imports `name` at some level (def, class, assignment,
    annotation, import, or a lazy table's key)."""
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b.*\b{name}\b|\"{name}\"",
                     source, re.M) is not None


def unresolved(dotted: str) -> str | None:
    """Why `dotted` (colo.a.b or colo.a.b.Name) names nothing in the source tree; None when it does."""
    if dotted in COMPILED:
        return None
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        module = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.exists()), None)
        if module is None:
            continue
        rest = parts[i:]
        if not rest or defined_in(module.read_text(), rest[0]):
            return None
        return f"{module.relative_to(REPO)} defines no {rest[0]}"
    return "no such module"


def test_every_dotted_colo_name_the_docs_use_exists():
    names = named(DOTTED)
    assert len(names) > 100
    missing = sorted((doc, name, why) for doc, name in names if (why := unresolved(name.rstrip("."))))
    assert not missing, missing
    assert unresolved("colo.grpo.overlap.EarlyTraining") and unresolved("colo.grpo.hf_format")  # the check bites
