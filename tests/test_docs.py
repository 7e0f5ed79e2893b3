"""The README a newcomer reads: short, its two commands the ones CI runs, and every relative link alive."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def code_lines(text: str) -> list[str]:
    """The lines inside fenced code blocks."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line.strip())
    return lines


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_readme_test_command_is_what_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    command = ci[-1]  # the last line: the test command itself
    assert "pytest" in command
    assert command in code_lines(README.read_text())


def test_readme_app_command_is_there():
    assert "bash setup.sh && python3 app.py" in code_lines(README.read_text())


def test_readme_keeps_the_spaces_front_matter():
    head = README.read_text().split("---")[1]
    for key in ("sdk: gradio", "app_file: app.py", 'python_version: "3.12"'):
        assert key in head


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = unquote(target.split("#")[0])
        if not (doc.parent / path).exists():
            broken.append(target)
    assert broken == []
