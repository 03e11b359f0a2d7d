"""README.md stays short; every relative link in it and docs/*.md resolves (file and #anchor)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slugs(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", text), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(text: str, page: Path) -> list[str]:
    """The relative links in `text` (the content of `page`) whose file or anchor is missing."""
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = page.parent / path
        if path and not file.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and (not path or file.suffix == ".md"):
            content = file.read_text(encoding="utf-8") if path else text
            if anchor not in slugs(content):
                broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    problems = [b for page in PAGES for b in broken_links(page.read_text(encoding="utf-8"), page)]
    assert problems == []


def test_the_checker_reports_broken_links():
    """Negative control: a missing file and a missing heading are both caught."""
    text = "# Title\n\n[ok](#title) [gone](no-such-file.md) [bad](README.md#no-such-heading)\n"
    assert broken_links(text, ROOT / "page.md") == [
        "page.md: no-such-file.md (no such file)",
        "page.md: README.md#no-such-heading (no such heading)",
    ]


def test_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def unnamed_modules(text: str) -> list[str]:
    """The library's modules (package/module.py, no __init__) that `text` does not name."""
    packages = [p.parent for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"]
    modules = [m for p in packages for m in p.glob("*.py") if m.name != "__init__.py"]
    return sorted(
        str(m.relative_to(ROOT)) for m in modules if f"`{m.parent.name}/{m.name}`" not in text
    )


def test_architecture_md_names_every_module():
    assert unnamed_modules((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")) == []
    assert "model/gpt.py" in unnamed_modules("`model/config.py`")  # negative control


def test_the_folders_the_docs_commands_write_are_ignored_by_git():
    """`out=exports/...` in a documented command leaves no untracked folder in a clone."""
    written = {m for page in PAGES for m in re.findall(r"\bout=([\w.-]+)/", page.read_text())}
    ignored = set((ROOT / ".gitignore").read_text().splitlines())
    assert "exports" in written and {f"{folder}/" for folder in written} <= ignored
