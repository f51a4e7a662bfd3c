"""grafana/mmcache.json against Grafana's own dashboard schema (npm @grafana/schema).

The schema ships as TypeScript types: the dashboard is written out as a typed object
literal and the TypeScript compiler checks it (unknown keys, wrong types, enum values).
`scripts/install_grafana_schema.sh` installs both; without them the test is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from dashboard_queries import DASHBOARD_PATH

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = Path(os.environ.get("MMCACHE_GRAFANA_SCHEMA_DIR", ROOT / "build" / "grafana-schema"))
TSC = SCHEMA_DIR / "node_modules" / ".bin" / "tsc"

#: The schema's enums become the strings and numbers a JSON file holds; the rest is as is.
PRELUDE = """import type { Dashboard } from "@grafana/schema";
type Json<T> = T extends string ? `${T}`
  : T extends number | boolean | null | undefined ? T
  : T extends (infer U)[] ? Json<U>[]
  : { [K in keyof T]: Json<T[K]> };
export const dashboard: Json<Dashboard> = """


def _typed(dashboard: dict[str, Any]) -> str:
    # __inputs and __requires are the import's, not the dashboard model's.
    model = {k: v for k, v in dashboard.items() if k not in ("__inputs", "__requires")}
    return PRELUDE + json.dumps(model, indent=1) + ";\n"


def _compile(sources: dict[str, str]) -> dict[str, list[str]]:
    """Run tsc over the sources (by file stem); the error lines of each."""
    with tempfile.TemporaryDirectory(dir=SCHEMA_DIR) as work:
        paths = []
        for stem, text in sources.items():
            path = Path(work) / f"{stem}.ts"
            path.write_text(text)
            paths.append(str(path))
        done = subprocess.run(
            [
                str(TSC),
                "--noEmit",
                "--strict",
                "--module",
                "esnext",
                "--target",
                "es2022",
                "--moduleResolution",
                "bundler",
                *paths,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=SCHEMA_DIR,
        )
    errors: dict[str, list[str]] = {stem: [] for stem in sources}
    for line in done.stdout.splitlines():
        match = re.match(r".*?([\w-]+)\.ts\(\d+,\d+\): error", line)
        if match and match.group(1) in errors:
            errors[match.group(1)].append(line)
    assert done.returncode == 0 or any(errors.values()), done.stdout + done.stderr
    return errors


@pytest.mark.skipif(
    not TSC.exists() or not (SCHEMA_DIR / "node_modules" / "@grafana" / "schema").exists(),
    reason="Grafana's schema is not installed: run scripts/install_grafana_schema.sh "
    "(needs Node.js and npm)",
)
def test_dashboard_matches_grafanas_schema() -> None:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    broken = json.loads(json.dumps(dashboard))
    panel = next(p for p in broken["panels"] if p["type"] == "timeseries")
    panel["gridPos"]["h"] = "eight"  # a wrong type
    panel["fieldConfig"]["defaults"]["color"]["mode"] = "rainbow"  # not an enum value
    broken["templating"]["list"][0]["refreshes"] = 1  # an unknown key
    errors = _compile({"mmcache": _typed(dashboard), "broken": _typed(broken)})
    assert errors["mmcache"] == []
    assert len(errors["broken"]) == 3, errors["broken"]  # the check can fail, and does here
