"""The documents the code points to are in the repository (no-kernel tier): every
`docs/<name>.md` named in the package, the tests, the scripts and the examples exists in docs/,
the project notes kept outside the repository (style, design, environment, layout) are never
cited as if they were here, and the paths and links the docs give exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SCANNED = ("toolkit", "analyses", "probes", "tests", "scripts", "examples")
SUFFIXES = {".py", ".sh", ".c", ".h", ".md", ".txt", ".toml", ".json", ".cfg"}
#: the project's notes that live beside the checkout, not in it: their facts belong in docs/,
#: in the README, or inline
OUTSIDE_NOTES = ("style", "design", "environment", "layout")
DOC_REF = re.compile(r"docs/([\w-]+\.md)\b")
NOTE_REF = re.compile(r"(?<![\w-])(" + "|".join(OUTSIDE_NOTES) + r")\.md\b")


def _text_files():
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and (p.suffix in SUFFIXES or p.name == "Makefile") and p != Path(__file__).resolve() \
                    and "__pycache__" not in p.parts and "build" not in p.relative_to(ROOT).parts[:2]:
                yield p
    yield ROOT / "README.md"
    yield ROOT / "Makefile"


def test_every_docs_reference_names_a_file_in_docs():
    bad = []
    for p in _text_files():
        text = p.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            for m in DOC_REF.finditer(line):
                if not (DOCS / m.group(1)).is_file():
                    bad.append(f"{p.relative_to(ROOT)}:{i}: docs/{m.group(1)} is not in docs/")
            for m in NOTE_REF.finditer(line):
                if not (DOCS / f"{m.group(1)}.md").is_file():
                    bad.append(f"{p.relative_to(ROOT)}:{i}: {m.group(0)} is not in the repository "
                               "(point to a file in docs/ or the README, or state the fact)")
    assert not bad, "\n".join(bad)


def test_the_paths_and_links_of_the_docs_exist():
    """Backticked repository paths (`analyses/age.py`, `toolkit/reports/`) and relative links
    ([run-directory.md](run-directory.md)) in docs/*.md name files that exist."""
    path = re.compile(r"`((?:toolkit|analyses|probes|tests|scripts|examples|docs)/[\w./-]*)`")
    link = re.compile(r"\]\(([\w.-]+\.md)\)")
    bad = []
    for doc in sorted(DOCS.glob("*.md")):
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in path.finditer(line):
                if not (ROOT / m.group(1)).exists():
                    bad.append(f"docs/{doc.name}:{i}: `{m.group(1)}` does not exist")
            for m in link.finditer(line):
                if not (DOCS / m.group(1)).is_file():
                    bad.append(f"docs/{doc.name}:{i}: link {m.group(1)} does not exist")
    assert not bad, "\n".join(bad)


def test_the_checks_see_a_dangling_reference():
    assert DOC_REF.search("see docs/style.md for").group(1) == "style.md"
    assert DOC_REF.search("../shared/docs/environment.md").group(1) == "environment.md"
    assert DOC_REF.search("sglang-jax docs/features/return_routed_experts.md") is None  # another project's
    assert NOTE_REF.search("(environment.md, \"Measured\")").group(1) == "environment"
    assert NOTE_REF.search("matrix_summary.md") is None
