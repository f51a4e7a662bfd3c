"""The reference documents every setting, environment variable and metric the code defines, the
README starts with its two commands and links the reference, the tests the docs cite exist, and
the changelog keeps its layout: one line of at most 300 characters per entry."""

from __future__ import annotations

import re
from pathlib import Path

from mmcache.metrics import METRICS_TABLE
from mmcache.settings import SETTINGS_TABLE

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def test_every_setting_and_variable_is_in_the_reference() -> None:
    for row in SETTINGS_TABLE:
        assert f"`{row.field}`" in REFERENCE, row.field
        for name in row.env_names:
            assert f"`{name}`" in REFERENCE, name


def test_the_reference_gives_each_settings_default_and_meaning() -> None:
    rows = {
        cells[0].strip("`"): cells
        for line in REFERENCE.splitlines()
        if line.startswith("| `")
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }
    for row in SETTINGS_TABLE:
        cells = rows[row.field]
        default = "unset" if row.default is None else f"`{row.default}`"
        assert cells[2] == default, f"{row.field}: the reference says {cells[2]}, code {default}"
        assert cells[3] == row.description, row.field


def test_every_metric_is_in_the_reference() -> None:
    for metric in METRICS_TABLE:
        assert f"`{metric.name}`" in REFERENCE, metric.name


def test_the_readme_links_the_reference() -> None:
    assert "(docs/reference.md#settings)" in README
    assert "(docs/reference.md#metrics)" in README


def test_the_readme_starts_with_its_two_commands() -> None:
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in block] == [
        "bash scripts/run demo",
        "bash scripts/run test",
    ]


def test_every_test_the_docs_cite_exists() -> None:
    """`test_x.py::name` and the `::other` after it on the same line name real tests."""
    defined = {
        path.name: set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
        for path in (ROOT / "tests").glob("*/test_*.py")
    }
    missing, cited = [], 0
    docs = (ROOT / "README.md", ROOT / "docs" / "guarantees.md", ROOT / "docs" / "reference.md")
    for doc in docs:
        for line in doc.read_text().splitlines():
            module = None
            for m in re.finditer(r"`(test_\w+\.py)?(?:::(\w+))?`", line):
                module = m.group(1) or module
                if m.group(2):
                    cited += 1
                    if module is None or m.group(2) not in defined.get(module, set()):
                        missing.append(f"{doc.name}: {module}::{m.group(2)}")
    assert cited > 50
    assert missing == []


CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
CHANGELOG_SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_every_changelog_entry_is_one_line_of_at_most_300_characters() -> None:
    lines = CHANGELOG.splitlines()
    long, wrapped = [], []
    for number, (line, after) in enumerate(zip(lines, [*lines[1:], ""], strict=True), 1):
        if not line.startswith("- "):
            continue
        if len(line) > 300:
            long.append(f"line {number}: {len(line)} characters")
        if after.strip() and not after.startswith(("- ", "#")):
            wrapped.append(f"line {number}: the entry goes on on the next line")
    assert long == []
    assert wrapped == []


def test_the_changelog_sections_are_keep_a_changelogs() -> None:
    assert "\n## [Unreleased]\n" in CHANGELOG
    unreleased = CHANGELOG.split("\n## [Unreleased]\n", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^#+ .*$", unreleased, re.M)
    assert headings, "the Unreleased section has no subsections"
    for heading in headings:
        assert heading.startswith("### ") and heading[4:] in CHANGELOG_SECTIONS, heading
    for heading in re.findall(r"^### (.*)$", CHANGELOG, re.M):
        assert heading in CHANGELOG_SECTIONS, heading
    for section in re.split(r"^### .*$", unreleased, flags=re.M)[1:]:
        assert any(line.startswith("- ") for line in section.splitlines()), "an empty subsection"
