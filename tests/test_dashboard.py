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


def test_cost_per_token_by_quantization_joins_the_model_info_by_pod():
    """One series per (quantization, KV-cache dtype): the pods' costs weighted by their tokens, the
    labels taken from tandem_model_info by pod."""
    d = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in d["panels"] if p["title"] == "Cost per million tokens by quantization"]
    (target,) = panel["targets"]
    expr = target["expr"]
    assert panel["fieldConfig"]["defaults"]["unit"] == "currencyUSD"
    assert expr.count("sum by (quantization, kv_cache_dtype)") == 2
    assert expr.count("group_left (quantization, kv_cache_dtype) tandem_model_info") == 2
    assert "tandem_cost_per_million_tokens_usd" in expr and "rate(tandem_generation_tokens_total" in expr
    assert "{{quantization}}" in target["legendFormat"] and "{{kv_cache_dtype}}" in target["legendFormat"]


def test_the_autoscaler_panels_query_only_metrics_the_operator_exports():
    """The operator's panels name series that operator/metrics.py really exports (each kind of
    series recorded once, then the registry rendered as Prometheus scrapes it)."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from tandem.operator.metrics import OperatorMetrics

    m = OperatorMetrics()
    m.decided("ml", "chat", "Hold", "WithinBand")
    m.scrape_failed("ml", "chat", "Timeout")
    m.observed("ml", "chat", 2, 3, 2)
    with m.tick("Operator"):
        pass
    m.leading(lambda: True)
    m.learned("ml", "chat", 1.8, 4, 52.0)
    exported = {
        sample.name
        for family in text_string_to_metric_families(m.render().decode())
        for sample in family.samples
    }
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    wanted = {n for e in exprs for n in re.findall(r"\b(tandem_operator_[a-z_]+)\b", e)}
    # replicas, desired, ready, decisions, failed scrapes, tick, leader, burst growth, headroom, pod start
    assert len(wanted) >= 10, wanted
    assert wanted <= exported, f"not exported by the operator: {wanted - exported}"
