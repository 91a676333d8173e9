"""KServe ModelStatistics and RepositoryIndex through tritonclient, on a pod of two front processes:
whichever front a client reaches answers with the statistics of every request the pod served, through
every API (KServe, the native API, OpenAI HTTP).

Like test_kserve_api.py, this process never imports `tandem.kserve` (tritonclient's protos register
the same `inference.*` package).
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from serverproc import ServerFactory, peer_ports, pod_pids

if "tandem.kserve.grpc_service_pb2" in sys.modules:  # pragma: no cover - a guard for the whole suite
    raise ImportError("tandem.kserve is imported in this process; tritonclient's protos would clash with it")

import tritonclient.grpc as tc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tandem.v1 import tandem_pb2 as pb  # noqa: E402
from tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "tiny-stats"
FRONTS = 2
TIMEOUT = 60.0
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # a TCP connection of its own per client
STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


@dataclass
class Pod:
    address: str
    http_port: int
    fronts: list[int]
    proc: subprocess.Popen

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def pod(serve: ServerFactory) -> Pod:
    live = serve("--model-name", MODEL, "--api-processes", str(FRONTS), http=True)
    _, fronts = pod_pids(live.log)
    assert len(fronts) == FRONTS
    return Pod(live.address, live.http_port, fronts, live.proc)


@pytest.fixture(scope="module")
def clients(pod: Pod) -> Iterator[list[tc.InferenceServerClient]]:
    """One client per front: connections are opened until each front holds one (SO_REUSEPORT spreads
    them at random)."""
    by_front: dict[int, tc.InferenceServerClient] = {}
    spare = []
    for _ in range(64):
        before = {front: peer_ports(front, pod.port) for front in pod.fronts}
        client = tc.InferenceServerClient(url=pod.address, channel_args=OWN_CONNECTION)
        assert client.is_server_ready(client_timeout=TIMEOUT)
        reached = [front for front in pod.fronts if peer_ports(front, pod.port) - before[front]]
        assert len(reached) == 1
        if reached[0] in by_front:
            spare.append(client)
        else:
            by_front[reached[0]] = client
        if len(by_front) == FRONTS:
            break
    assert len(by_front) == FRONTS, "64 connections all reached one front"
    yield list(by_front.values())
    for client in [*by_front.values(), *spare]:
        client.close()


def llm_inputs(prompt: str, max_tokens: int, sampling: str = "{}") -> list[tc.InferInput]:
    out = []
    for name, datatype, value in (
        ("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_)),
        ("max_tokens", "INT32", np.array([max_tokens], dtype=np.int32)),
        ("sampling_parameters", "BYTES", np.array([sampling.encode()], dtype=np.object_)),
    ):
        t = tc.InferInput(name, [1], datatype)
        t.set_data_from_numpy(value)
        out.append(t)
    return out


def stream_infer(client: tc.InferenceServerClient, prompt: str, max_tokens: int) -> None:
    """ModelStreamInfer (decoupled: one response per chunk), until the final response."""
    got: list[tuple[tc.InferResult | None, InferenceServerException | None]] = []
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        client.async_stream_infer(MODEL, llm_inputs(prompt, max_tokens))
        deadline = time.monotonic() + TIMEOUT
        while not any(r is not None and _final(r) for r, _ in got):
            assert not any(e is not None for _, e in got), got
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        client.stop_stream()


def _final(result: tc.InferResult) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def statistics(client: tc.InferenceServerClient, name: str = MODEL) -> dict:
    response = client.get_inference_statistics(name, as_json=True, client_timeout=TIMEOUT)
    [model] = response["model_stats"]
    return model


def counts(stats: dict) -> dict[str, int]:
    """Every count in a model's statistics (JSON leaves out zeros; uint64 comes as a string)."""
    infer = stats.get("inference_stats", {})
    out = {k: int(stats.get(k, 0)) for k in ("inference_count", "execution_count")}
    for k in ("success", "fail", *STAGES):
        out[k] = int(infer.get(k, {}).get("count", 0))
    return out


def nanoseconds(stats: dict, what: str) -> int:
    return int(stats.get("inference_stats", {}).get(what, {}).get("ns", 0))


def test_statistics_count_every_request_of_the_pod(pod: Pod, clients: list[tc.InferenceServerClient]):
    before = statistics(clients[0])
    started_ms = time.time() * 1000
    observed = 0.0  # the successful requests' time as their clients saw it, seconds
    for i, client in enumerate(clients):  # two KServe requests through each front
        for stream in (False, True):
            t0 = time.perf_counter()
            if stream:
                stream_infer(client, f"Story {i}", 5)
            else:
                client.infer(MODEL, llm_inputs(f"Tale {i}", 4), client_timeout=TIMEOUT)
            observed += time.perf_counter() - t0
    with pytest.raises(InferenceServerException) as refused:  # fails in admission: counted as a failure
        clients[1].infer(MODEL, llm_inputs("Bad", 4, sampling="{not json"), client_timeout=TIMEOUT)
    assert "not valid JSON" in refused.value.message()
    with pytest.raises(InferenceServerException) as elsewhere:  # another model's: counted nowhere
        clients[0].infer("no-such-model", llm_inputs("Lost", 4), client_timeout=TIMEOUT)
    assert elsewhere.value.status() == "StatusCode.NOT_FOUND"
    with grpc.insecure_channel(pod.address) as channel:  # the native API is counted as well
        t0 = time.perf_counter()
        native = pb.GenerateRequest(text="Native", stopping=pb.StoppingCriteria(max_tokens=3))
        pb_grpc.TandemStub(channel).Generate(native, timeout=TIMEOUT)
        observed += time.perf_counter() - t0
    conn = http.client.HTTPConnection("127.0.0.1", pod.http_port, timeout=TIMEOUT)  # and OpenAI HTTP
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "HTTP", "max_tokens": 3}))
    assert conn.getresponse().status == 200
    observed += time.perf_counter() - t0
    conn.close()
    succeeded = 2 * len(clients) + 2

    expected = {k: v + succeeded for k, v in counts(before).items() if k != "fail"}
    expected["fail"] = counts(before)["fail"] + 1
    deadline = time.monotonic() + 10  # each front sends its records on its own socket: they arrive soon
    while True:
        answers = [statistics(client) for client in clients]  # one from each front
        if all(counts(a) == expected for a in answers) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for answer in answers:
        assert counts(answer) == expected
        assert answer["name"] == MODEL and answer["version"] == "1"
        assert started_ms <= int(answer["last_inference"]) <= time.time() * 1000
    after = answers[0]
    assert answers[1] == after  # the pod's statistics, whichever front answers

    def spent(what: str) -> int:
        return nanoseconds(after, what) - nanoseconds(before, what)

    assert 0 < spent("success") <= observed * 1e9  # the server's time is within the clients' wait
    assert spent("fail") > 0
    assert spent("compute_infer") > 0 and spent("compute_input") > 0
    # the four stages cut each successful request's time, nothing more (a nanosecond of rounding each)
    stages = sum(spent(s) for s in STAGES)
    assert abs(stages - spent("success")) <= 4 * succeeded


def test_statistics_of_another_model_or_version_are_not_found(clients: list[tc.InferenceServerClient]):
    everything = clients[0].get_inference_statistics(as_json=True, client_timeout=TIMEOUT)
    assert [m["name"] for m in everything["model_stats"]] == [MODEL]  # no name: every model
    for name, version in (("no-such-model", ""), (MODEL, "2")):
        with pytest.raises(InferenceServerException) as exc:
            clients[0].get_inference_statistics(name, version, client_timeout=TIMEOUT)
        assert exc.value.status() == "StatusCode.NOT_FOUND"


def test_repository_index_lists_the_served_model_ready(clients: list[tc.InferenceServerClient]):
    for client in clients:
        index = client.get_model_repository_index(as_json=True, client_timeout=TIMEOUT)
        assert index["models"] == [{"name": MODEL, "version": "1", "state": "READY"}]
        assert client.is_model_ready(MODEL)


def test_repository_index_says_unavailable_while_draining(pod: Pod, clients: list[tc.InferenceServerClient]):
    """Stops the pod: runs last. A stream keeps the front draining while the index is asked."""
    stream_done = []
    client = clients[0]
    client.start_stream(callback=lambda result, error: stream_done.append((result, error)))
    client.async_stream_infer(MODEL, llm_inputs("A long story", 400, '{"stop": []}'), request_id="long")
    while not stream_done:
        time.sleep(0.01)
    pod.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while client.is_model_ready(MODEL) and time.monotonic() < deadline:
        time.sleep(0.02)
    index = client.get_model_repository_index(as_json=True, client_timeout=TIMEOUT)
    [entry] = index["models"]
    assert (entry["name"], entry["state"]) == (MODEL, "UNAVAILABLE")
    assert "draining" in entry["reason"]
    client.stop_stream(cancel_requests=True)
