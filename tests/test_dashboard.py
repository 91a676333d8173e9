"""The Grafana dashboard the chart ships: valid, generated, parameterised by a Prometheus datasource.

(That every query names a metric the server really exports is checked against a live server in
test_telemetry_server.py.)
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "charts" / "tandem" / "dashboards" / "tandem.json"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_dashboard", ROOT / "scripts" / "gen_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dashboard_is_the_generators_output():
    assert json.loads(DASHBOARD.read_text()) == _generator().dashboard(), "run scripts/gen_dashboard.py"


def test_every_panel_queries_the_datasource_variable():
    d = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    titles = {p["title"] for p in d["panels"]}
    for wanted in ("GPU idle fraction", "Cost per million tokens", "Tokens per second", "Queue", "Replicas"):
        assert wanted in titles
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(
            t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in p["targets"]
        )
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
