"""`tandem operator`: its settings from TANDEM_OPERATOR_* and flags, as the Helm chart sets them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.operator.settings import OperatorSettings


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TANDEM_OPERATOR_NAMESPACES", "ml, staging,")
    monkeypatch.setenv("TANDEM_OPERATOR_LEADER_ELECTION", "true")
    monkeypatch.setenv("TANDEM_OPERATOR_LEADER_ELECTION_NAMESPACE", "tandem-system")
    monkeypatch.setenv("TANDEM_OPERATOR_LIVENESS_PORT", "8080")
    monkeypatch.setenv("TANDEM_OPERATOR_LOG_LEVEL", "warning")
    s = OperatorSettings()
    assert s.namespace_list() == ["ml", "staging"]
    assert (s.leader_election, s.leader_election_namespace) == (True, "tandem-system")
    assert (s.liveness_port, s.log_level) == (8080, "WARNING")
    assert OperatorSettings(namespaces="").namespace_list() == []  # all namespaces


def test_cli_lists_every_setting_with_its_variable():
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "operator", "--help"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for name in OperatorSettings.model_fields:
        assert f"--{name.replace('_', '-')}" in text and f"TANDEM_OPERATOR_{name.upper()}" in text


def test_cli_rejects_a_bad_setting():
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.run(
        [str(tandem), "operator", "--scrape-interval-s", "-1"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    assert proc.returncode != 0 and "scrape_interval_s" in proc.stderr


def test_lease_timings_must_let_the_leader_stop_before_another_may_start():
    OperatorSettings(leader_election=True)  # client-go's defaults: 15 s > 10 s > 1.2 x 2 s
    with pytest.raises(ValueError, match="lease duration > renew deadline"):
        OperatorSettings(leader_election=True, lease_duration_s=10, renew_deadline_s=10)
