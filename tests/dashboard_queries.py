"""Read grafana/mmcache.json and expand its PromQL the way Grafana would before sending it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "grafana" / "mmcache.json"

# Grafana's forms: $name, ${name}, ${name:format} and the deprecated [[name]].
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One target of one panel, with its expression as Grafana would send it."""

    panel: str
    ref_id: str
    expr: str


@dataclass(frozen=True, slots=True)
class VariableQuery:
    """A `label_values(selector, label)` template variable, expanded."""

    name: str
    selector: str
    label: str


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict[str, Any]:
    """Return the dashboard JSON as a dict."""
    with path.open(encoding="utf-8") as f:
        dashboard: dict[str, Any] = json.load(f)
    return dashboard


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Yield every panel that is not a row, including those inside collapsed rows."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expand(expr: str, variables: Mapping[str, str]) -> str:
    """Substitute template variables; an unknown variable raises KeyError."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name not in variables:
            raise KeyError(f"{expr!r} uses ${name}, which is not one of {sorted(variables)}")
        return variables[name]

    return _VARIABLE.sub(value, expr)


def grafana_variables(
    *,
    rate_interval: str = "1m",
    interval: str = "15s",
    instance: str = ".*",
    cache: str = ".*",
) -> dict[str, str]:
    """Return the values Grafana gives the variables (the regexes are what "All" sends)."""
    return {
        "__rate_interval": rate_interval,
        "__interval": interval,
        "instance": instance,
        "cache": cache,
    }


def panel_queries(
    dashboard: Mapping[str, Any] | None = None,
    *,
    rate_interval: str = "1m",
    interval: str = "15s",
    instance: str = ".*",
    cache: str = ".*",
) -> list[PanelQuery]:
    """Return every panel target's expression, expanded."""
    dashboard = load_dashboard() if dashboard is None else dashboard
    variables = grafana_variables(
        rate_interval=rate_interval, interval=interval, instance=instance, cache=cache
    )
    return [
        PanelQuery(panel["title"], target["refId"], expand(target["expr"], variables))
        for panel in iter_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def variable_queries(
    dashboard: Mapping[str, Any] | None = None, *, instance: str = ".*"
) -> list[VariableQuery]:
    """Return the query variables' label_values() selectors, expanded."""
    dashboard = load_dashboard() if dashboard is None else dashboard
    variables = {"instance": instance}
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text.strip())
        if match is None:
            raise ValueError(f"variable {variable['name']}: {text!r} is not label_values(...)")
        selector = expand(match["selector"] or "", variables)
        found.append(VariableQuery(variable["name"], selector, match["label"]))
    return found
