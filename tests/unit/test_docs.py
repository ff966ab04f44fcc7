"""The docs point at things that exist. docs/design.md stays an architecture page (under
``MAX_DESIGN_LINES``); every repository path it names exists, and so does every bare file name
(``flow.py``) somewhere in the tree; every markdown link of the docs and lab notes resolves; and
every reference of the form ``docs/<file>.md, "Section"`` in the repository names a heading or
a bold label (``- **Section**``) of that file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
MAX_DESIGN_LINES = 450
TOP_DIRS = ("pdserve", "bench", "tests", "docs", "deploy", "protos", "examples")
DOCS = [DESIGN, *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "bench" / "NOTES.md",
        *sorted((ROOT / "bench" / "notes").glob("*.md"))]
# Where a section reference may be written: the docs, the lab's notes and scripts, the product.
REFERRING = ("README.md", "docs/*.md", "bench/*.md", "bench/notes/*.md", "bench/*.py", "bench/*.sh",
             "pdserve/**/*.py", "tests/**/*.py")

PATH_RE = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_DIRS) + r")/[\w./{},*-]*)")
BARE_FILE_RE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|proto|sh|json|yaml))(?![\w/])")
REL_FILE_RE = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.(?:py|proto|sh|json|yaml|md))(?![\w/])")
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SECTION_REF_RE = re.compile(r"((?:docs|bench)/[\w/]+\.md|README\.md),\s+\"([^\"]+)\"")


def _expand(path: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``; a path with a template part (``{epoch}``) -> []."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    if "," not in m.group(1):
        return []
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    path = path.rstrip(".,;:")
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_design_is_short() -> None:
    n = len(DESIGN.read_text().splitlines())
    assert n < MAX_DESIGN_LINES, f"docs/design.md has {n} lines: measurements go to bench/notes/"


def test_design_paths_exist() -> None:
    text = DESIGN.read_text()
    missing = sorted({p for raw in PATH_RE.findall(text) for p in _expand(raw) if not _exists(p)})
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"
    files = ["/" + p.relative_to(ROOT).as_posix() for d in TOP_DIRS if (ROOT / d).is_dir()
             for p in (ROOT / d).rglob("*") if p.is_file()]
    names = {f.rsplit("/", 1)[1] for f in files}
    bare = sorted({f for f in BARE_FILE_RE.findall(text) if f not in names})
    assert not bare, f"docs/design.md names files found nowhere in {TOP_DIRS}: {bare}"
    partial = sorted({r for r in REL_FILE_RE.findall(text) if r.split("/", 1)[0] not in TOP_DIRS
                      and not any(f.endswith("/" + r) for f in files)})
    assert not partial, f"docs/design.md names files found nowhere in {TOP_DIRS}: {partial}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc: Path) -> None:
    bad = [t for t in LINK_RE.findall(doc.read_text())
           if "://" not in t and not t.startswith("mailto:") and not (doc.parent / t).exists()]
    assert not bad, f"{doc.relative_to(ROOT)}: links to missing files {bad}"


def _anchors(doc: Path) -> list[str]:
    """Headings (without their #) and bold labels that open a list item or a paragraph."""
    out = []
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            out.append(line.lstrip("#").strip())
        elif m := re.match(r"\s*(?:- )?\*\*([^*]+)\*\*", line):
            out.append(m.group(1).strip())
    return out


def test_section_references_resolve() -> None:
    files = {p for pattern in REFERRING for p in ROOT.glob(pattern) if p.is_file()}
    bad = []
    for f in sorted(files):
        for target, section in SECTION_REF_RE.findall(" ".join(f.read_text(errors="replace").split())):
            doc = ROOT / target
            if not doc.exists():
                bad.append(f"{f.relative_to(ROOT)}: {target} does not exist")
            elif not any(a.startswith(section) for a in _anchors(doc)):
                bad.append(f"{f.relative_to(ROOT)}: {target} has no section {section!r}")
    assert not bad, "\n".join(bad)
