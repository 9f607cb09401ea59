"""The docs name only repository paths that exist, and no path of somebody's machine: a reader
can run every command they show (README.md, CHANGELOG.md, docs/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A path inside the repository, not part of a longer path (``~/.cache/specgen/...`` is not one).
REPO_PATH = re.compile(r"(?<![\w/~.-])((?:scripts|examples|conf|tests|specgen|prompts|grammars|docs)/[\w./-]*)")
#: A path of a local machine's run folders or home directories.
LOCAL_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|root|mnt|Users)/[\w./-]*")


def missing_paths(text: str, root: Path) -> list[str]:
    """Repository paths named in ``text`` that do not exist under ``root``."""
    names = {match.rstrip(".,:;") for match in REPO_PATH.findall(text)}
    return sorted(name for name in names if not (root / name).exists())


def local_paths(text: str) -> list[str]:
    return sorted(set(LOCAL_PATH.findall(text)))


def test_docs_name_only_paths_that_exist_in_the_repo():
    assert len(DOCS) > 3
    found = {doc.name: missing_paths(doc.read_text(encoding="utf-8"), ROOT) for doc in DOCS}
    assert not {name: paths for name, paths in found.items() if paths}


def test_docs_name_no_local_machine_paths():
    found = {doc.name: local_paths(doc.read_text(encoding="utf-8")) for doc in DOCS}
    assert not {name: paths for name, paths in found.items() if paths}


def test_negative_control_the_checks_find_what_they_look_for():
    text = ("Run `python scripts/no_such_probe.py` (see /work/runs/s43/host.py); caches live under\n"
            "~/.cache/specgen/grammars and scripts/quant_bench.py exists.")
    assert missing_paths(text, ROOT) == ["scripts/no_such_probe.py"]
    assert local_paths(text) == ["/work/runs/s43/host.py"]
