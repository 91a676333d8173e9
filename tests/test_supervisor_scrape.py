"""A scrape of the pod's /metrics counts what was reported before it: the supervisor's receiving
thread records the engine's and the fronts' reports, and a scrape waits for it to catch up."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request

import zmq
from prometheus_client import CollectorRegistry

from tandem.service import contract as c
from tandem.service.ipc import sockets
from tandem.service.runtime.drained import Drained
from tandem.service.runtime.supervisor import Supervisor
from tandem.service.settings import ServerSettings
from tandem.service.telemetry.http import MetricsServer


def test_the_receiving_thread_is_caught_up_once_it_recorded_what_was_delivered():
    """Forty reports reach a supervisor whose recording is slow (20 ms each): a wait that begins
    once they are delivered (a client's answer comes after its report) ends only after all forty
    are recorded."""
    supervisor = Supervisor(ServerSettings(metrics_port=0, telemetry=False), "INFO")
    recorded: list[object] = []

    def slow_record(msg: object) -> None:
        time.sleep(0.02)
        recorded.append(msg)

    supervisor.telemetry.record = slow_record  # type: ignore[method-assign]
    ctx = zmq.Context()
    sender = sockets.push(ctx, supervisor.endpoints.supervisor)
    try:
        supervisor._receiver.start()
        sender.send(c.encode(c.RequestRecord("text_completion", "m", 0.0)))
        deadline = time.monotonic() + 10
        while not recorded and time.monotonic() < deadline:  # connected, and the thread running
            time.sleep(0.01)
        for i in range(40):
            sender.send(c.encode(c.RequestRecord("text_completion", "m", 0.1 * i)))
        time.sleep(0.2)  # delivered: the thread has recorded a few of them, and is busy
        assert 1 < len(recorded) < 41
        assert supervisor.drained.wait(10.0)
        assert len(recorded) == 41
        # idle: a wait wakes the thread, which finds its inbox empty at once (not after its 200 ms
        # poll timeout: ten waits would then take one to two seconds)
        started = time.monotonic()
        for _ in range(10):
            assert supervisor.drained.wait(10.0)
        assert time.monotonic() - started < 1.0
        # and, woken, it takes the wake and sleeps again: half a second idle costs no CPU to speak of
        cpu = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - cpu < 0.1
    finally:
        supervisor._closing.set()
        supervisor._receiver.join(timeout=10)
        sender.close(linger=0)
        ctx.term()
        supervisor.zmq.term()
        shutil.rmtree(supervisor.folder, ignore_errors=True)
    assert not supervisor.drained.wait(0.5)  # stopped: nobody catches up, nobody waits long


def test_a_wait_without_a_receiving_thread_returns_at_once():
    drained = Drained()
    started = time.monotonic()
    try:
        assert not drained.wait(5.0)
    finally:
        drained.close()
    assert time.monotonic() - started < 1.0


def test_a_scrape_is_answered_after_the_hook_before_it():
    """MetricsServer calls `before_scrape` before it renders /metrics (not for /healthz)."""
    released = threading.Event()
    calls: list[float] = []

    def hold() -> None:
        calls.append(time.monotonic())
        released.wait(5.0)

    server = MetricsServer("127.0.0.1", 0, registry=CollectorRegistry(), before_scrape=hold)
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
            assert r.status == 200 and not calls
        threading.Timer(0.3, released.set).start()
        started = time.monotonic()
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            assert r.status == 200
        assert len(calls) == 1 and time.monotonic() - started >= 0.25
    finally:
        server.stop()
