"""The /metrics and /healthz endpoint over real HTTP on loopback."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from tandem.service.telemetry.http import MetricsServer


def test_metrics_healthz_and_404():
    registry = CollectorRegistry()
    Counter("tandem_test_things", "things", registry=registry).inc(3)
    alive = [True]
    server = MetricsServer("127.0.0.1", 0, lambda: alive[0], registry)
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        assert families["tandem_test_things"].samples[0].value == 3.0
        with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
            assert r.status == 200
        alive[0] = False  # the engine thread died: the kubelet should restart the pod
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/healthz", timeout=10)
        assert err.value.code == 503
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/", timeout=10)
        assert err.value.code == 404
    finally:
        server.stop()
