"""The pod's processes, on real servers: several fronts on one gRPC port and one HTTP port feeding one
engine process, the queue bound kept across them, coalesced streams, and what happens when a process
dies."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.client
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from serverproc import ServerFactory, descendants, free_port, peer_ports, pod_pids, wait_gone

from tandem.health import wait_serving
from tandem.service.api_processes import auto_api_processes
from tandem.service.cpus import usable_cores
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

TIMEOUT = 60.0
FRONTS = 3
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # a channel of its own, not a shared one


def request(max_tokens: int, text: str = "Once upon a time") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.get("le")
    }


# -- several fronts ------------------------------------------------------------------------------


class Pod:
    def __init__(
        self, address: str, proc: subprocess.Popen, log: Path, metrics_url: str, http_port: int
    ) -> None:
        self.address, self.proc, self.log, self.metrics_url = address, proc, log, metrics_url
        self.port = int(address.rsplit(":", 1)[1])
        self.http_port = http_port
        self.engine, self.fronts = pod_pids(log)


def http_post(port: int, body: dict, conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
    """POST /v1/completions on the pod's HTTP port (on `conn`, kept open, when given)."""
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


@pytest.fixture(scope="module")
def pod(serve: ServerFactory) -> Pod:
    live = serve(
        "--api-processes", str(FRONTS), "--max-waiting-requests", "2", "--max-num-seqs", "2",
        "--stream-interval", "5", metrics=True, http=True,
    )  # fmt: skip
    return Pod(live.address, live.proc, live.log, live.metrics_url, live.http_port)


def test_every_front_serves_on_the_one_port_and_is_counted_once(pod: Pod):
    before = scrape(pod.metrics_url)
    channels = [grpc.insecure_channel(pod.address, options=OWN_CONNECTION) for _ in range(48)]
    try:
        for ch in channels:  # health, reflection-free calls and generation on every connection
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert check.status == SERVING
        results = [pb_grpc.TandemStub(ch).Generate(request(6), timeout=TIMEOUT) for ch in channels]
        # the kernel spread the connections over the fronts (SO_REUSEPORT): each holds some
        served = [peer_ports(front, pod.port) for front in pod.fronts]
        assert all(served), [len(s) for s in served]
        assert sum(len(s) for s in served) >= len(channels)
        texts = {r.text for r in results}
        assert len(texts) == 1 and all(len(r.token_ids) == 6 for r in results)  # greedy: one answer
    finally:
        for ch in channels:
            ch.close()
    after = scrape(pod.metrics_url)  # the pod's one endpoint counts every front's requests once
    assert after["tandem_generation_tokens_total"] - before["tandem_generation_tokens_total"] == 6 * 48
    duration = "gen_ai_server_request_duration_seconds_count"
    assert after[duration] - before.get(duration, 0) == 48


def test_the_fronts_serve_without_loading_torch(pod: Pod):
    """The fronts tokenize and detokenize with transformers' tokenizers, which need no torch: having
    served (a chat request, templated and detokenized by a front), none of them has torch's library
    mapped, which the engine has."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", pod.http_port, timeout=TIMEOUT)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and json.loads(reply.read())["choices"][0]["message"]["content"]

    def maps_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    assert maps_torch(pod.engine)
    assert not [front for front in pod.fronts if maps_torch(front)]


def test_every_front_serves_http_on_the_one_port(pod: Pod):
    """Each front binds the HTTP port too (SO_REUSEPORT): connections reach all of them, each answers."""
    conns = [http.client.HTTPConnection("127.0.0.1", pod.http_port, timeout=TIMEOUT) for _ in range(24)]
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        answers = [http_post(pod.http_port, body, c) for c in conns]
        assert {status for status, _ in answers} == {200}
        assert len({json.loads(raw)["choices"][0]["text"] for _, raw in answers}) == 1  # greedy
        served = [peer_ports(front, pod.http_port) for front in pod.fronts]
        assert all(served), [len(s) for s in served]
        for c in conns[:FRONTS]:  # readiness on each connection, as the gRPC health says
            c.request("GET", "/ready")
            r = c.getresponse()
            assert (r.status, json.loads(r.read())) == (200, {"status": "ready"})
    finally:
        for c in conns:
            c.close()


def test_the_queue_bound_holds_across_fronts(pod: Pod):
    """2 running, 2 waiting, whichever fronts they came through; the next is turned away."""
    channels = [grpc.insecure_channel(pod.address, options=OWN_CONNECTION) for _ in range(12)]
    calls = []
    try:
        refused = 0
        for ch in channels[:4]:
            calls.append(pb_grpc.TandemStub(ch).GenerateStream(request(800), timeout=TIMEOUT))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            load = pb_grpc.TandemStub(channels[0]).GetLoad(pb.LoadRequest(), timeout=TIMEOUT)
            if (load.requests_running, load.requests_waiting) == (2, 2):  # all four in, a step taken
                break
            time.sleep(0.05)
        assert (load.requests_running, load.requests_waiting) == (2, 2)
        for ch in channels[4:]:
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.TandemStub(ch).Generate(request(4), timeout=TIMEOUT)
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value.details()
            assert "queue is full" in exc.value.details()
            refused += 1
        assert refused == 8
        for stream in (False, True):  # over HTTP: 429, a stream too (it starts with its first chunk)
            status, raw = http_post(pod.http_port, {"prompt": "Once", "max_tokens": 4, "stream": stream})
            error = json.loads(raw)["error"]
            assert status == 429 and error["code"] == "rate_limit_exceeded", raw
            assert "queue is full" in error["message"]
    finally:
        for call in calls:
            call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = pb_grpc.TandemStub(channels[0]).GetLoad(pb.LoadRequest(), timeout=TIMEOUT)
        idle = load.requests_running == load.requests_waiting == 0
        if idle and load.kv_blocks_free == load.kv_blocks_total:
            break
        time.sleep(0.05)
    assert load.kv_blocks_free == load.kv_blocks_total  # the cancelled ones freed their blocks
    assert len(pb_grpc.TandemStub(channels[-1]).Generate(request(3), timeout=TIMEOUT).token_ids) == 3
    for ch in channels:
        ch.close()


def test_a_second_server_on_the_port_refuses_to_start(pod: Pod, tmp_path):
    """The pod's own fronts share its port; another `tandem serve` may not join them."""
    log = tmp_path / "second.log"
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1", "--port", str(pod.port),
           "--metrics-port", "0", "--http-port", "0", "--device", "cpu"]  # fmt: skip
    with log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=60, cwd="/",
                              env={**os.environ, "PYTHONSAFEPATH": "1"}).returncode  # fmt: skip
    assert code == 1
    assert f"port {pod.port} on 127.0.0.1 is in use" in log.read_text()
    with grpc.insecure_channel(pod.address) as ch:  # and the pod goes on serving alone
        assert len(pb_grpc.TandemStub(ch).Generate(request(3), timeout=TIMEOUT).token_ids) == 3


def test_a_burst_is_refused_with_resource_exhausted_never_cancelled(pod: Pod):
    """2,000 calls at once (grpc core alone would drop about a tenth as CANCELLED): every call ends
    OK or RESOURCE_EXHAUSTED, and no more than the bound ever waits."""

    async def burst() -> tuple[collections.Counter, int]:
        calls, watch = grpc.aio.insecure_channel(pod.address), grpc.aio.insecure_channel(pod.address)
        async with calls, watch:
            stub, load_stub = pb_grpc.TandemStub(calls), pb_grpc.TandemStub(watch)
            most_waiting, done = 0, False

            async def one() -> str:
                try:
                    await stub.Generate(request(2), timeout=120)
                    return "OK"
                except grpc.aio.AioRpcError as err:
                    return err.code().name

            async def sample() -> None:
                nonlocal most_waiting
                while not done:
                    load = await load_stub.GetLoad(pb.LoadRequest(), timeout=TIMEOUT)
                    most_waiting = max(most_waiting, load.requests_waiting)
                    await asyncio.sleep(0.01)

            sampler = asyncio.ensure_future(sample())
            statuses = collections.Counter(await asyncio.gather(*[one() for _ in range(2000)]))
            done = True
            await sampler
            return statuses, most_waiting

    statuses, most_waiting = asyncio.run(burst())
    assert set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, statuses
    assert statuses["OK"] >= 4 and statuses["RESOURCE_EXHAUSTED"] > 0, statuses
    assert most_waiting <= 2


# -- coalescing ----------------------------------------------------------------------------------


def test_a_stream_interval_coalesces_and_delivers_every_token_once_in_order(pod: Pod):
    """The pod runs with --stream-interval 5: the stream carries what the unary call returns."""
    req = request(64, "Tell me a story about the sea")
    with grpc.insecure_channel(pod.address) as ch:
        stub = pb_grpc.TandemStub(ch)
        whole = stub.Generate(req, timeout=TIMEOUT)
        coalesced = list(stub.GenerateStream(req, timeout=TIMEOUT))
    assert len(whole.token_ids) == 64
    assert [t for m in coalesced for t in m.token_ids] == list(whole.token_ids)
    assert "".join(m.text for m in coalesced) == whole.text
    assert all(len(m.token_ids) >= 5 for m in coalesced[1:-1])  # the first token is never held back
    assert len(coalesced) <= 1 + math.ceil(63 / 5)
    assert coalesced[-1].usage.completion_tokens == 64


# -- a process dies ------------------------------------------------------------------------------


def test_a_dead_engine_ends_streams_unavailable_turns_health_down_and_exits_1(serve: ServerFactory):
    with serve.started(http=True) as live:
        address, proc, log, http_port = live.address, live.proc, live.log, live.http_port
        engine, _ = pod_pids(log)
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert next(health).status == SERVING
            stream = pb_grpc.TandemStub(ch).GenerateStream(request(1000), timeout=TIMEOUT)
            next(stream)
            sse = http.client.HTTPConnection("127.0.0.1", http_port, timeout=TIMEOUT)
            body = {"prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            sse.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            http_stream = sse.getresponse()
            assert http_stream.status == 200
            statuses: list[tuple[int, float]] = []

            def watch() -> None:
                try:
                    for update in health:
                        statuses.append((update.status, time.monotonic()))
                except grpc.RpcError:
                    pass  # the front stopped after saying so

            watcher = threading.Thread(target=watch)
            watcher.start()
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as exc:
                for _ in stream:
                    pass
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value.details()
            assert time.monotonic() - killed < 5
            # the HTTP stream (its status long sent) ends with an OpenAI error event, then [DONE]
            events = http_stream.read().split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            assert json.loads(events[-3].removeprefix(b"data: "))["error"]["code"] == "service_unavailable"
            sse.close()
            watcher.join(timeout=20)
            down = [at for status, at in statuses if status == NOT_SERVING]
            assert down, "health never said NOT_SERVING"
            assert down[0] - killed < 1.0, f"NOT_SERVING {down[0] - killed:.2f} s after the engine died"
        assert proc.wait(timeout=20) == 1
    assert "the engine process ended" in log.read_text()


def test_a_default_server_sizes_its_fronts_and_a_killed_supervisor_ends_them(serve: ServerFactory):
    """`--api-processes auto`, the default, as its rule says for this host (the engine on the CPU: 1);
    then the supervisor is killed, and its processes go with it."""
    with serve.started() as live:
        proc, log = live.proc, live.log
        engine, fronts = pod_pids(log)
        expected = auto_api_processes(usable_cores(), on_cuda=False)
        assert len(fronts) == expected
        assert f"api_processes auto: {expected} front process(es), the engine on the CPU" in log.read_text()
        proc.kill()
        proc.wait()
        assert not wait_gone({engine, *fronts}, 10), "children outlived the supervisor"


# Starts `tandem serve` (argv[1:]) and waits on it, as a script or a test harness would; prints its pid.
LAUNCHER = "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); p.wait()"


def test_a_server_whose_parent_dies_stops(tiny_model_dir, tmp_path):
    """The process that started `tandem serve` is killed: the server stops as on SIGTERM, its
    processes with it (outside a container: there its parent is an init that never dies)."""
    log = tmp_path / "server.log"
    port = free_port()
    cmd = [sys.executable, "-c", LAUNCHER, sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--http-port", "0", "--metrics-port", "0",
           "--kv-cache-cpu-gib", "0.25", "--model", str(tiny_model_dir("llama"))]  # fmt: skip
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, text=True, cwd="/",
                                    env={**os.environ, "PYTHONSAFEPATH": "1"})  # fmt: skip
    server = None
    try:
        server = int(launcher.stdout.readline())
        wait_serving(f"127.0.0.1:{port}", 180.0, lambda: launcher.poll() is None)
        processes = {server, *descendants(server)}
        assert len(processes) >= 3  # the supervisor, the engine, a front (and the resource tracker)
        launcher.kill()
        launcher.wait()
        left = wait_gone(processes, 15)
        assert not left, f"still running after their parent was killed: {left}"
        assert "has ended; stopping" in log.read_text()
    finally:  # whatever failed, nothing is left running
        launcher.kill()
        for pid in {server, *descendants(server)} if server else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
