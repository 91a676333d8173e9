"""Deadlines on a real server: the server's own bound on a request (--request-timeout-s), KServe's
`timeout` parameter, and a request whose deadline passes while it waits, which never starts."""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverproc import ServerFactory, wait_idle

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

TIMEOUT = 60.0
# The server's bound: short, so that the longest request the tiny model's context allows (1,000
# tokens) outlasts it on a fast host too; the tests size their requests by the host's measured speed
SERVER_BOUND_S = 1.2
MODEL = "tiny-deadlines"


def request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text="Once upon a time", stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    )


def prompt_tokens(url: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return next(
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "tandem_prompt_tokens_total"
    )  # fmt: skip


def seconds_per_token(stub: pb_grpc.TandemStub) -> float:
    """This host's pace for one stream of the tiny model (the tests size requests by it), from a
    request short enough to finish well inside the server's bound on a slow host too."""
    stub.Generate(request(20), timeout=TIMEOUT)
    started = time.monotonic()
    stub.Generate(request(60), timeout=TIMEOUT)
    return (time.monotonic() - started) / 60


@pytest.fixture(scope="module")
def server(serve: ServerFactory) -> Iterator[tuple[str, str]]:
    live = serve(
        "--model-name", MODEL, "--request-timeout-s", str(SERVER_BOUND_S), "--max-num-seqs", "1", metrics=True
    )  # fmt: skip
    yield live.address, live.metrics_url
    text = live.log.read_text()  # every deadline above ended with its status, none with a traceback
    assert "Traceback" not in text and "ExecuteBatchError" not in text, text[-5000:]


def test_the_server_bound_ends_a_long_stream_and_frees_its_blocks(server):
    address, _ = server
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.TandemStub(ch)
        assert 1000 * seconds_per_token(stub) > SERVER_BOUND_S + 0.5, "this host outruns the bound"
        started, got = time.monotonic(), 0
        with pytest.raises(grpc.RpcError) as exc:
            for msg in stub.GenerateStream(request(1000), timeout=TIMEOUT):  # far longer than the bound
                got += len(msg.token_ids)
        took = time.monotonic() - started
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value.details()
        assert "deadline" in exc.value.details()
        assert SERVER_BOUND_S - 0.2 < took < SERVER_BOUND_S + 3 and 0 < got < 1000
        wait_idle(stub, timeout=10)
        assert len(stub.Generate(request(3), timeout=TIMEOUT).token_ids) == 3  # and it serves on


def test_kserve_timeout_parameter_is_the_requests_deadline(server):
    """Triton's `timeout` request parameter, in microseconds."""
    address, _ = server
    from tritonclient.grpc import service_pb2 as kpb
    from tritonclient.grpc import service_pb2_grpc as kpb_grpc

    def infer(timeout_us: int | None, max_tokens: int) -> kpb.ModelInferResponse:
        text = kpb.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1])
        text.contents.bytes_contents.append(b"The sky is")
        tokens = kpb.ModelInferRequest.InferInputTensor(name="max_tokens", datatype="INT32", shape=[1])
        tokens.contents.int_contents.append(max_tokens)
        req = kpb.ModelInferRequest(model_name=MODEL, inputs=[text, tokens])
        if timeout_us is not None:
            req.parameters["timeout"].int64_param = timeout_us
        with grpc.insecure_channel(address) as ch:
            return kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=TIMEOUT)

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:
        infer(300_000, 1000)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value.details()
    assert time.monotonic() - started < SERVER_BOUND_S  # its own 0.3 s, not the server's bound
    for bad in (0, -5):
        with pytest.raises(grpc.RpcError) as exc:
            infer(bad, 3)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout" in exc.value.details()
    assert infer(5_000_000, 3).outputs[0].name == "text_output"


def test_a_request_whose_deadline_passes_while_it_waits_never_starts(server):
    """One sequence runs at a time: the second request waits behind the first, and its client
    deadline passes there; it is never prefilled (its prompt tokens are never counted). The first
    asks for more tokens than the server's bound lets it make (the host's pace does not matter) and
    is cancelled once the second has failed."""
    address, metrics = server
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.TandemStub(ch)
        wait_idle(stub, timeout=10)
        first_prompt = stub.Generate(request(1), timeout=TIMEOUT).usage.prompt_tokens
        wait_idle(stub, timeout=10)
        time.sleep(0.6)  # the engine reports its counters at least every 0.5 s
        before = prompt_tokens(metrics)
        first = stub.GenerateStream(request(1000), timeout=TIMEOUT)
        next(first)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(request(5), timeout=0.3)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        first.cancel()
        wait_idle(stub, timeout=10)
        time.sleep(0.6)
        assert first_prompt > 0 and prompt_tokens(metrics) - before == first_prompt


def test_deadlines_that_expire_with_ours_end_quietly(server):
    """Unary calls whose client deadline and the server's copy of it expire together: each gets
    DEADLINE_EXCEEDED, and none makes the server log an abort that failed in grpc core."""
    address, _ = server
    rng = random.Random(0)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.TandemStub(ch)
        for _ in range(8):
            calls = [
                stub.Generate.future(
                    pb.GenerateRequest(
                        text="hello " * rng.randint(1, 50),
                        stopping=pb.StoppingCriteria(max_tokens=500, ignore_eos=True),
                    ),
                    timeout=rng.uniform(0.01, 0.5),
                )
                for _ in range(64)
            ]
            for call in calls:
                assert call.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK), call.details()
        wait_idle(stub, timeout=10)
