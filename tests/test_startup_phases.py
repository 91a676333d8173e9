"""The start-up's phases: timed, added up, named, and carried from the engine's EngineReady to the
pod's metrics (the real server's /metrics: test_telemetry_server.py)."""

from __future__ import annotations

import time

import pytest

from tandem.service import contract as c
from tandem.service.settings import ServerSettings
from tandem.service.telemetry.pod import PodTelemetry
from tandem.service.telemetry.startup import PHASES, StartupClock, process_started_at


def test_a_phase_timed_twice_adds_up_and_the_summary_keeps_the_phases_order():
    clock = StartupClock()
    with clock.phase("warm_up"):
        time.sleep(0.02)
    clock.add("weights", 1.25)
    clock.add("weights", 0.5)
    clock.add("compile", -0.001)  # a remainder that came out below zero by rounding
    assert clock.seconds["weights"] == 1.75 and clock.seconds["compile"] == 0.0
    assert clock.seconds["warm_up"] >= 0.02
    assert clock.summary().startswith("weights 1.8 s, compile 0.0 s, warm_up 0.0 s")


def test_an_unknown_phase_is_refused_by_name():
    with pytest.raises(ValueError, match="'loading'.*spawn"):
        StartupClock().add("loading", 1.0)


def test_the_process_started_before_now_and_after_the_interpreter_could_have():
    started = process_started_at()
    assert time.time() - 3600 * 24 * 365 < started <= time.time()


def test_the_pod_reports_the_engines_phases_once_it_is_ready():
    telemetry = PodTelemetry(ServerSettings(metrics_port=0, telemetry=False))
    try:
        assert telemetry.metrics.startup() == ({}, None)
        info = c.ModelInfo("m", "/m", "LlamaForCausalLM", "float32", "cpu", [2], "/m", "none", "float32")
        phases = {p: float(i) for i, p in enumerate(PHASES)}
        sent = c.EngineReady(info, c.Limits(512, 4096, 256, 8, 256), phases)
        telemetry.record(c.decoder(c.ToSupervisor).decode(c.encode(sent)))  # as it crosses the socket
        telemetry.serving_after_s = 20.0
        assert telemetry.metrics.startup() == (phases, 20.0)
    finally:
        telemetry.shutdown()
