"""grpc.health.v1, server reflection and the SIGTERM drain, against real `tandem serve` processes.

What app.py promises: the gRPC server is up (health NOT_SERVING) before the model loads, SERVING
once it is warm; SIGTERM turns health NOT_SERVING at once, new generations get UNAVAILABLE, running
streams may finish for --drain-timeout-s, then the server stops and the process exits with 0.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from serverproc import TINY_SERVER_MODEL, descendants, free_port, wait_gone

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 30.0
SERVICES = {
    "tandem.v1.Tandem",
    "inference.GRPCInferenceService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
}
PROMPT = "Tell me a long story about"
# reconnect quickly while the server process is still starting (the default backoff grows to minutes)
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
]


@pytest.fixture(scope="module")
def server(tiny_server: str) -> str:
    return tiny_server  # conftest's: the tiny llama as TINY_SERVER_MODEL


@pytest.fixture(scope="module")
def channel(server: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server) as ch:
        yield ch


def check(channel: grpc.Channel, service: str = "", timeout: float = TIMEOUT) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def kserve_server_ready(channel: grpc.Channel) -> bool:
    """inference.GRPCInferenceService/ServerReady without KServe stubs (tritonclient's would clash with
    ours in one process): the request is empty, the response is `bool ready = 1`."""
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ServerReady",
        request_serializer=lambda _: b"",
        response_deserializer=lambda raw: raw,
    )
    raw = call(None, timeout=TIMEOUT)
    assert raw in (b"", b"\x08\x01"), raw
    return raw == b"\x08\x01"


def long_request(max_tokens: int) -> pb.GenerateRequest:
    stopping = pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(text=PROMPT, stopping=stopping)


# -- health -------------------------------------------------------------------------------------


def test_health_serving_when_ready(channel: grpc.Channel) -> None:
    for service in ("", "tandem.v1.Tandem", "inference.GRPCInferenceService"):
        assert check(channel, service) == SERVING, service
    assert kserve_server_ready(channel)


def test_health_unknown_service(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        check(channel, "no.such.Service")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Tandem"), timeout=TIMEOUT)
    try:
        assert next(watch).status == SERVING
    finally:
        watch.cancel()


# -- reflection ---------------------------------------------------------------------------------


def test_reflection_lists_services(channel: grpc.Channel) -> None:
    db = ProtoReflectionDescriptorDatabase(channel)
    assert SERVICES <= set(db.get_services())


def test_reflection_describes_the_apis(channel: grpc.Channel) -> None:
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    tandem = pool.FindServiceByName("tandem.v1.Tandem")
    methods = {m.name for m in tandem.methods}
    assert methods == {"Generate", "GenerateStream", "Tokenize", "GetModelInfo", "GetLoad"}
    assert tandem.methods_by_name["GenerateStream"].server_streaming
    request = pool.FindMessageTypeByName("tandem.v1.GenerateRequest")
    assert {"text", "chat", "token_ids"} == {f.name for f in request.oneofs_by_name["input"].fields}

    kserve = pool.FindServiceByName("inference.GRPCInferenceService")
    assert {"ServerLive", "ServerReady", "ModelReady", "ModelMetadata", "ModelInfer", "ModelStreamInfer",
            "ModelConfig", "ServerMetadata"} <= {m.name for m in kserve.methods}
    stream = kserve.methods_by_name["ModelStreamInfer"]
    assert stream.client_streaming and stream.server_streaming


def test_reflection_is_enough_to_call_the_server(channel: grpc.Channel) -> None:
    """A grpcurl-style generic client: message classes built only from reflected descriptors."""
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindServiceByName("tandem.v1.Tandem").methods_by_name["GetModelInfo"]
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_unary(
        "/tandem.v1.Tandem/GetModelInfo",
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    info = call(request_cls(), timeout=TIMEOUT)
    assert info.model == TINY_SERVER_MODEL
    assert info.architecture == "LlamaForCausalLM"


# -- start-up and drain -------------------------------------------------------------------------


def spawn(model: Path, log: Path, *extra: str, own_group: bool = False) -> tuple[str, subprocess.Popen]:
    """Start `tandem serve` without waiting for it (serverproc.running_server waits for SERVING);
    `own_group`: in a process group (and session) of its own, as a service manager starts it."""
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--http-port", "0", "--model", str(model), *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd="/",
                                env={**os.environ, "PYTHONSAFEPATH": "1"}, start_new_session=own_group)
    return f"127.0.0.1:{port}", proc


def assert_clean_exit(proc: subprocess.Popen, processes: set[int], log: Path) -> None:
    """The server exited with 0, every process it started is gone (the resource tracker, which reports
    what the others leaked, writes to the log last), and the log holds no warning of a leak or a
    traceback."""
    assert proc.wait(timeout=15) == 0, log.read_text()[-3000:]
    assert not wait_gone(processes, 15), "processes outlived the server"
    text = log.read_text()
    for sign in ("leaked", "resource_tracker", "Traceback", "exited with code"):
        assert sign not in text, text[-3000:]


def http_get(port: int, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """GET `path` (POST `body` when given) on the HTTP port; (status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("POST" if body else "GET", path, json.dumps(body) if body else None)
    resp = conn.getresponse()
    return resp.status, resp.read()


def first_health(channel: grpc.Channel, proc: subprocess.Popen, timeout: float = 120.0) -> int:
    """Poll until the gRPC server answers a health check at all; return that first status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            return check(channel, timeout=0.5)
        except grpc.RpcError:
            time.sleep(0.01)
    pytest.fail("the server never answered a health check")


def wait_for_status(channel: grpc.Channel, status: int, timeout: float) -> float:
    """Poll health until it reports `status`; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        if check(channel) == status:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"health did not turn {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
        time.sleep(0.02)


@pytest.fixture
def stop_leftover() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_not_serving_until_ready_then_graceful_drain(
    tiny_model_dir, tmp_path: Path, stop_leftover: list[subprocess.Popen]
) -> None:
    http_port = free_port()
    flags = ("--drain-timeout-s", "60", "--http-port", str(http_port))
    address, proc = spawn(tiny_model_dir("llama"), tmp_path / "server.log", *flags)
    stop_leftover.append(proc)
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        stub = pb_grpc.TandemStub(channel)
        # the gRPC server is up before the model is loaded and warm: NOT_SERVING, no generation
        assert first_health(channel, proc) == NOT_SERVING
        try:
            stub.Generate(long_request(2), timeout=TIMEOUT)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert "not ready" in err.details() or "loading" in err.details()
        else:  # only if the model became ready in between
            assert check(channel) == SERVING
        wait_for_status(channel, SERVING, timeout=120)
        assert kserve_server_ready(channel)
        assert http_get(http_port, "/ready")[0] == 200  # HTTP readiness follows the gRPC health

        # a stream is running on each port when SIGTERM arrives
        n_tokens = 300
        stream = stub.GenerateStream(long_request(n_tokens), timeout=TIMEOUT)
        got = len(next(stream).token_ids)
        sse = http.client.HTTPConnection("127.0.0.1", http_port, timeout=TIMEOUT)
        body = {"prompt": PROMPT, "max_tokens": n_tokens, "ignore_eos": True, "stream": True}
        sse.request("POST", "/v1/completions", json.dumps(body))
        http_stream = sse.getresponse()
        assert http_stream.status == 200
        processes = descendants(proc.pid)  # the engine, the fronts, the resource tracker
        proc.send_signal(signal.SIGTERM)
        assert wait_for_status(channel, NOT_SERVING, timeout=2.0) < 2.0
        for service in ("tandem.v1.Tandem", "inference.GRPCInferenceService"):
            assert check(channel, service) == NOT_SERVING
        assert not kserve_server_ready(channel)
        assert http_get(http_port, "/ready") == (503, b'{"status":"not ready"}')
        assert http_get(http_port, "/health")[0] == 200  # live: the pod is finishing, not stuck
        # new generations are turned away while draining
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(long_request(2), timeout=TIMEOUT)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in exc.value.details()
        status, refused = http_get(http_port, "/v1/completions", {"prompt": PROMPT})
        assert status == 503 and "draining" in json.loads(refused)["error"]["message"]
        # ... but the running streams are allowed to finish
        last = None
        for last in stream:
            got += len(last.token_ids)
        assert got == n_tokens
        assert last is not None and last.finish_reason == pb.FINISH_REASON_LENGTH
        events = http_stream.read().split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        assert json.loads(events[-3].removeprefix(b"data: "))["choices"][0]["finish_reason"] == "length"
        sse.close()
        t_done = time.monotonic()

    # no stream left: the server stops well before the 60 s drain timeout, and exits cleanly
    assert_clean_exit(proc, processes, tmp_path / "server.log")
    assert time.monotonic() - t_done < 15


def test_sigterm_to_the_whole_process_group_drains_as_well(
    tiny_model_dir, tmp_path: Path, stop_leftover: list[subprocess.Popen]
) -> None:
    """A service manager (systemd's default) or `timeout` signals every process of the server at once:
    the streams still finish, and the server exits as cleanly as when only it is signalled."""
    log = tmp_path / "server.log"
    address, proc = spawn(tiny_model_dir("llama"), log, "--drain-timeout-s", "60", own_group=True)
    stop_leftover.append(proc)
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        first_health(channel, proc)
        wait_for_status(channel, SERVING, timeout=120)
        n_tokens = 200
        stream = pb_grpc.TandemStub(channel).GenerateStream(long_request(n_tokens), timeout=TIMEOUT)
        got = len(next(stream).token_ids)
        processes = descendants(proc.pid)
        assert len(processes) >= 3  # the engine, a front, the resource tracker
        os.killpg(proc.pid, signal.SIGTERM)
        assert wait_for_status(channel, NOT_SERVING, timeout=2.0) < 2.0
        for message in stream:
            got += len(message.token_ids)
        assert got == n_tokens
    assert_clean_exit(proc, processes, log)


def test_drain_timeout_cuts_long_streams(
    tiny_model_dir, tmp_path: Path, stop_leftover: list[subprocess.Popen]
) -> None:
    drain_s = 0.2  # short: the longest stream the tiny model's context allows must outlast drain + grace
    address, proc = spawn(tiny_model_dir("llama"), tmp_path / "server.log", "--drain-timeout-s", str(drain_s))
    stop_leftover.append(proc)
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        first_health(channel, proc)
        wait_for_status(channel, SERVING, timeout=120)
        stub = pb_grpc.TandemStub(channel)
        n_tokens = 1000
        started = time.monotonic()
        stub.Generate(long_request(100), timeout=TIMEOUT)
        pace = (time.monotonic() - started) / 100
        assert n_tokens * pace > drain_s + 1.0 + 0.5, "this host outruns the drain timeout and its grace"
        stream = stub.GenerateStream(long_request(n_tokens), timeout=TIMEOUT)
        got = len(next(stream).token_ids)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as exc:
            for message in stream:
                got += len(message.token_ids)
        t_cut = time.monotonic() - t_term
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, exc.value.details()
        assert got < n_tokens
        # cut after the drain timeout plus the 1 s stop grace, not long after
        assert drain_s + 0.9 <= t_cut <= drain_s + 1.0 + 3.0

    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - t_term < drain_s + 15


def test_sigterm_while_the_model_loads_exits_at_once(
    tmp_path: Path, stop_leftover: list[subprocess.Popen]
) -> None:
    """A pod deleted during its first start (the GGUF still converting, tens of seconds on two
    cores) exits at once with status 0: the load is abandoned, not waited for."""
    from tandem.service.models.default_model import default_gguf_path

    cache, log = tmp_path / "cache", tmp_path / "server.log"
    address, proc = spawn(default_gguf_path(), log, "--cache-dir", str(cache))
    stop_leftover.append(proc)
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        assert first_health(channel, proc) == NOT_SERVING
        time.sleep(1.0)
        assert check(channel) == NOT_SERVING  # still converting
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
    assert time.monotonic() - sent < 10
    assert "not waiting for the load" in log.read_text()
    assert not list(cache.glob("*/config.json")), "the conversion finished: the exit waited for it"
