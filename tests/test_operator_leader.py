"""Leader election on a Lease (operator/leader.py) against kmock, with the API server's optimistic
concurrency on the Lease played by tests/leases.py: candidates racing for one Lease never lead
together, a leader that stops renewing is replaced only after the Lease expired, a released
Lease is taken at once; and two real `tandem operator` processes: only the leader writes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import kopf
import pytest
from leases import LeaseServer
from test_operator_e2e import MS, NS, declare_resources, eventually, model_server
from test_operator_own_metrics import served, value

from tandem.operator.kube import KubeApi, api_path
from tandem.operator.leader import LeaderElector, Timings

pytestmark = pytest.mark.asyncio

LEASE = "tandem-operator"
FAST = Timings(lease_duration_s=1.0, renew_deadline_s=0.7, retry_period_s=0.1)


TEST_AGENT = "tandem-test"  # the test's own requests, told apart from the operators'


def client(kmock: Any) -> KubeApi:
    api = KubeApi(kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True))
    api.headers["User-Agent"] = TEST_AGENT
    return api


async def test_candidates_never_lead_together_and_take_over_only_an_expired_lease(kmock) -> None:
    kmock.resources.load_bundled()
    server = LeaseServer(NS, LEASE).install(kmock)
    leading: set[str] = set()
    together: list[set[str]] = []
    stops = {i: asyncio.Event() for i in "abc"}

    def lead(identity: str):  # noqa: ANN202
        async def run() -> None:
            leading.add(identity)
            if len(leading) > 1:
                together.append(set(leading))
            try:
                await stops[identity].wait()  # acts until stopped (as kopf does) or cancelled
            finally:
                leading.discard(identity)

        return run

    apis = {i: client(kmock) for i in "abc"}
    electors = {i: LeaderElector(apis[i], NS, LEASE, i, FAST) for i in "abc"}
    tasks = {i: asyncio.create_task(electors[i].run(lead(i), stops[i])) for i in "abc"}  # all at once
    try:
        first = await eventually(lambda: server.holder(), timeout=10, what="a leader")
        await asyncio.sleep(1.0)  # ten renewals: the same leader, the others wait
        assert server.holder() == first and leading == {first}
        assert all(w.holder == first for w in server.writes), "a follower never writes while it is held"

        # the leader stops renewing (it crashed: no release); another takes over once it expired
        tasks[first].cancel()
        second = await eventually(
            lambda: server.holder() not in ("", first) and server.holder(), timeout=10, what="takeover"
        )
        (_, _, last_renewal), (_, taken, _) = server.terms()[-2:]
        assert taken - last_renewal >= FAST.lease_duration_s, "taken over before the Lease expired"
        # the Lease names it before its elector has started leading (the next turn of its task)
        await eventually(lambda: leading == {second}, timeout=5, what="the new holder leading")
        spec = server.lease["spec"]
        assert spec["leaseTransitions"] == 1 and spec["leaseDurationSeconds"] == 1
        assert spec["acquireTime"].endswith("Z") and spec["renewTime"] >= spec["acquireTime"]

        # a graceful stop releases the Lease: the third takes it at once, not a lease duration later
        stops[second].set()
        await tasks[second]
        (third,) = set("abc") - {first, second}
        await eventually(lambda: server.holder() == third, timeout=10, what="third leader")
        (_, _, released), (_, taken, _) = server.terms()[-2:]
        assert server.terms()[-2][0] == "", "released: no holder"
        assert taken - released < FAST.lease_duration_s
        assert server.lease["spec"]["leaseTransitions"] == 2
        assert not together, f"two led at once: {together}"
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for api in apis.values():
            await api.close()


def start_operator(
    kmock: Any, identity: str, host: str, log: Path, prometheus_port: int = 0
) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "TANDEM_OPERATOR_API_SERVER": str(kmock.url).rstrip("/").replace("127.0.0.1", host),
        "TANDEM_OPERATOR_LEADER_ELECTION": "true",
        "TANDEM_OPERATOR_LEADER_ELECTION_NAMESPACE": NS,
        "TANDEM_OPERATOR_LEADER_ELECTION_IDENTITY": identity,
        "TANDEM_OPERATOR_LEASE_DURATION_S": "1.5",
        "TANDEM_OPERATOR_RENEW_DEADLINE_S": "1.0",
        "TANDEM_OPERATOR_RETRY_PERIOD_S": "0.2",
        "TANDEM_OPERATOR_SCRAPE_INTERVAL_S": "0.5",
        "TANDEM_OPERATOR_LIVENESS_PORT": "0",
        "TANDEM_OPERATOR_PROMETHEUS_PORT": str(prometheus_port),
    }
    tandem = Path(sys.executable).with_name("tandem")
    out = log.open("w")
    return subprocess.Popen([str(tandem), "operator"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")


def requests_from(kmock: Any, host: str, writes_only: bool = True) -> list[str]:
    """What one operator process asked of the API (told apart by the Host it dials), Leases aside."""
    seen = []
    for r in list(kmock):
        if r.headers.get("Host", "").split(":")[0] != host or "/leases" in str(r.url):
            continue
        if r.headers.get("User-Agent") == TEST_AGENT:
            continue
        if writes_only and r.method.value == "GET":
            continue
        seen.append(f"{r.method.value} {r.url.path}")
    return seen


async def test_two_operator_processes_only_the_leader_acts(
    kmock, tmp_path: Path, unused_tcp_port_factory
) -> None:
    declare_resources(kmock)
    server = LeaseServer(NS, LEASE).install(kmock)
    hosts = {"a": "127.0.0.1", "b": "localhost"}
    ports = {i: unused_tcp_port_factory() for i in "ab"}
    procs = {i: start_operator(kmock, i, hosts[i], tmp_path / f"{i}.log", ports[i]) for i in "ab"}  # racing
    api = client(kmock)
    try:
        leader = await eventually(lambda: server.holder(), timeout=30, what="a leader")
        (follower,) = set("ab") - {leader}
        # each one's own /metrics says which one acts (a standby serves them too)
        assert value(await served(ports[leader]), "tandem_operator_leader") == 1.0
        assert value(await served(ports[follower]), "tandem_operator_leader") == 0.0
        await api.create(MS, model_server("one"))
        await eventually(lambda: api.get(api_path("apps/v1", "deployments", NS, "one")), what="Deployment")
        await asyncio.sleep(1.0)
        assert requests_from(kmock, hosts[leader]), "the leader acts"
        assert requests_from(kmock, hosts[follower], writes_only=False) == [], "a follower does nothing"

        # the leader stops renewing (frozen); the follower takes over once the Lease expired
        procs[leader].send_signal(signal.SIGSTOP)
        await eventually(lambda: server.holder() == follower, timeout=20, what="takeover")
        (_, _, last_renewal), (_, taken, _) = server.terms()[-2:]
        assert taken - last_renewal >= 1.5
        procs[leader].kill()

        async def leads(identity: str) -> bool:
            return value(await served(ports[identity]), "tandem_operator_leader") == 1.0

        await eventually(lambda: leads(follower), what="the new leader's gauge")
        await api.create(MS, model_server("two"))
        await eventually(
            lambda: api.get(api_path("apps/v1", "deployments", NS, "two")), what="Deployment two"
        )
        assert f"POST /apis/apps/v1/namespaces/{NS}/deployments" in requests_from(kmock, hosts[follower])

        procs[follower].send_signal(signal.SIGTERM)  # a rollout: the old pod releases the Lease
        assert await asyncio.to_thread(procs[follower].wait, 30) == 0
        assert server.holder() == ""
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        await api.close()
