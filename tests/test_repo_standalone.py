"""The repository stands alone: its documents never point outside it (no ../ paths, no files beside
the checkout), and every relative link in them names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]


def test_documents_point_nowhere_outside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert not re.search(r"(?<!\.)\.\./", text), (
            f"{doc.name} points outside the repository"
        )  # "..." is prose
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):  # markdown links
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (doc.parent / target).exists(), (
                f"{doc.name} links to {target}, which is not in the repository"
            )
