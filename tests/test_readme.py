"""The README documents every setting, environment variable and metric the code defines."""

from __future__ import annotations

from pathlib import Path

from mmcache.metrics import METRICS_TABLE
from mmcache.settings import SETTINGS_TABLE

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_setting_and_variable_is_in_the_readme() -> None:
    for row in SETTINGS_TABLE:
        assert f"`{row.field}`" in README, row.field
        for name in row.env_names:
            assert f"`{name}`" in README, name


def test_the_readme_gives_each_settings_default_and_meaning() -> None:
    rows = {
        cells[0].strip("`"): cells
        for line in README.splitlines()
        if line.startswith("| `")
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }
    for row in SETTINGS_TABLE:
        cells = rows[row.field]
        default = "unset" if row.default is None else f"`{row.default}`"
        assert cells[2] == default, f"{row.field}: README says {cells[2]}, the code {default}"
        assert cells[3] == row.description, row.field


def test_every_metric_is_in_the_readme() -> None:
    for metric in METRICS_TABLE:
        assert f"`{metric.name}`" in README, metric.name


def test_the_readme_starts_with_its_two_commands() -> None:
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in block] == [
        "bash scripts/run demo",
        "bash scripts/run test",
    ]
