"""The KServe v2 API (`inference.GRPCInferenceService`) driven by an independent client, tritonclient.

tritonclient's generated protos and ours both register the `inference.*` package, so this process
must never import `tandem.kserve`: the server under test runs as a subprocess, and the answers are
compared with the native API through the `tandem.v1` stubs (a different package, safe to import).
"""

from __future__ import annotations

import json
import queue
import sys
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from serverproc import TINY_SERVER_MODEL, wait_idle

if "tandem.kserve.grpc_service_pb2" in sys.modules:  # pragma: no cover - a guard for the whole suite
    raise ImportError("tandem.kserve is imported in this process; tritonclient's protos would clash with it")

import tritonclient.grpc as tc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tandem.v1 import tandem_pb2 as pb  # noqa: E402
from tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402

MODEL_NAME = TINY_SERVER_MODEL
TIMEOUT = 60.0
PROMPT = "In the beginning there was a small model that"
INPUT_NAMES = ["text_input", "max_tokens", "stream", "sampling_parameters", "exclude_input_in_output"]


@pytest.fixture(scope="module")
def server(tiny_server: str) -> str:
    return tiny_server  # conftest's: the tiny llama as MODEL_NAME


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(url=server)
    yield c
    c.close()


@pytest.fixture(scope="module")
def native(server: str) -> Iterator[pb_grpc.TandemStub]:
    with grpc.insecure_channel(server) as channel:
        yield pb_grpc.TandemStub(channel)


def native_text(native: pb_grpc.TandemStub, prompt: str, max_tokens: int) -> str:
    req = pb.GenerateRequest(text=prompt, stopping=pb.StoppingCriteria(max_tokens=max_tokens))
    return native.Generate(req, timeout=TIMEOUT).text


def llm_inputs(
    prompt: str | None = PROMPT,
    *,
    max_tokens: int | None = None,
    stream: bool | None = None,
    sampling: dict | str | None = None,
    exclude_input: bool | None = None,
) -> list[tc.InferInput]:
    """Triton's LLM tensors, each a one-element array."""
    out = []

    def add(name: str, datatype: str, value: np.ndarray) -> None:
        t = tc.InferInput(name, [1], datatype)
        t.set_data_from_numpy(value)
        out.append(t)

    if prompt is not None:
        add("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_))
    if max_tokens is not None:
        add("max_tokens", "INT32", np.array([max_tokens], dtype=np.int32))
    if stream is not None:
        add("stream", "BOOL", np.array([stream], dtype=bool))
    if sampling is not None:
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        add("sampling_parameters", "BYTES", np.array([raw.encode()], dtype=np.object_))
    if exclude_input is not None:
        add("exclude_input_in_output", "BOOL", np.array([exclude_input], dtype=bool))
    return out


def infer_text(client: tc.InferenceServerClient, prompt: str | None = PROMPT, **kwargs) -> str:
    """Unary ModelInfer; the text_output."""
    return text_output(client.infer(MODEL_NAME, llm_inputs(prompt, **kwargs), client_timeout=TIMEOUT))


def text_output(result: tc.InferResult) -> str:
    arr = result.as_numpy("text_output")
    assert arr is not None and arr.shape == (1,)
    return arr[0].decode()


# -- liveness, readiness, metadata --------------------------------------------------------------


def test_live_and_ready(client: tc.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL_NAME)
    assert not client.is_model_ready("no-such-model")


def test_server_metadata(client: tc.InferenceServerClient) -> None:
    meta = client.get_server_metadata()
    assert meta.name == "tandem"
    assert meta.version
    assert {"model_configuration", "statistics"} <= set(meta.extensions)


def test_model_metadata(client: tc.InferenceServerClient) -> None:
    meta = client.get_model_metadata(MODEL_NAME)
    assert meta.name == MODEL_NAME
    assert [i.name for i in meta.inputs] == INPUT_NAMES
    assert {i.name: i.datatype for i in meta.inputs}["text_input"] == "BYTES"
    assert [(o.name, o.datatype) for o in meta.outputs] == [("text_output", "BYTES")]
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_metadata("no-such-model")
    assert exc.value.status() == "StatusCode.NOT_FOUND"
    assert "no-such-model" in exc.value.message()


def test_model_config(client: tc.InferenceServerClient) -> None:
    config = client.get_model_config(MODEL_NAME).config
    assert config.name == MODEL_NAME
    assert config.model_transaction_policy.decoupled is True
    assert [i.name for i in config.input] == INPUT_NAMES
    optional = {i.name: i.optional for i in config.input}
    assert optional["text_input"] is False
    assert all(optional[n] for n in INPUT_NAMES[1:])
    assert [o.name for o in config.output] == ["text_output"]
    as_json = client.get_model_config(MODEL_NAME, as_json=True)
    assert as_json["config"]["model_transaction_policy"]["decoupled"] is True


# -- unary inference ----------------------------------------------------------------------------


def test_infer_matches_native_api(client: tc.InferenceServerClient, native: pb_grpc.TandemStub) -> None:
    expected = native_text(native, PROMPT, 16)
    assert expected

    result = client.infer(MODEL_NAME, llm_inputs(max_tokens=16, exclude_input=True), client_timeout=TIMEOUT)
    assert text_output(result) == expected
    response = result.get_response()
    assert response.model_name == MODEL_NAME

    # without exclude_input_in_output (and when it is false) the prompt comes first
    for exclude in (None, False):
        assert infer_text(client, max_tokens=16, exclude_input=exclude) == PROMPT + expected


def test_infer_sampling_parameters(client: tc.InferenceServerClient, native: pb_grpc.TandemStub) -> None:
    # max_tokens inside sampling_parameters, greedy by temperature 0
    expected = native_text(native, PROMPT, 8)
    result = client.infer(
        MODEL_NAME, llm_inputs(sampling={"max_tokens": 8, "temperature": 0}, exclude_input=True),
        client_timeout=TIMEOUT,
    )
    assert text_output(result) == expected

    # seeded sampling is reproducible, and matches the native API with the same seed
    sampling = {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 99}
    a = infer_text(client, max_tokens=12, sampling=sampling, exclude_input=True)
    b = infer_text(client, max_tokens=12, sampling=sampling, exclude_input=True)
    assert a == b
    req = pb.GenerateRequest(
        text=PROMPT,
        sampling=pb.SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99),
        stopping=pb.StoppingCriteria(max_tokens=12),
    )
    assert native.Generate(req, timeout=TIMEOUT).text == a


def test_infer_stop_string(client: tc.InferenceServerClient, native: pb_grpc.TandemStub) -> None:
    full = native_text(native, PROMPT, 24)
    stop = next(
        full[k : k + 2]
        for k in range(len(full) // 3, len(full) - 2)
        if full[k : k + 2].strip() and "\ufffd" not in full[k : k + 2] and full.find(full[k : k + 2]) > 0
    )
    expected = full[: full.find(stop)]
    assert infer_text(client, max_tokens=24, sampling={"stop": [stop]}, exclude_input=True) == expected
    assert infer_text(client, max_tokens=24, sampling={"stop": stop}, exclude_input=True) == expected


def test_infer_unknown_model(client: tc.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as exc:
        client.infer("no-such-model", llm_inputs(max_tokens=4))
    assert exc.value.status() == "StatusCode.NOT_FOUND"
    assert "no-such-model" in exc.value.message()


# -- decoupled streaming ------------------------------------------------------------------------


class StreamCollector:
    """A tritonclient stream callback that queues (result, error) pairs."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, result: tc.InferResult | None, error: InferenceServerException | None) -> None:
        self.items.put((result, error))

    def get(self) -> tuple[tc.InferResult | None, InferenceServerException | None]:
        return self.items.get(timeout=TIMEOUT)

    def until_final(self) -> list[tc.InferResult]:
        """Responses up to and including the one marked triton_final_response; fails on an error."""
        out = []
        while True:
            result, error = self.get()
            assert error is None, error.message()
            out.append(result)
            if is_final(result):
                return out


def is_final(result: tc.InferResult) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


@pytest.fixture
def stream(client: tc.InferenceServerClient) -> Iterator[StreamCollector]:
    collector = StreamCollector()
    client.start_stream(callback=collector, stream_timeout=TIMEOUT)
    try:
        yield collector
    finally:
        client.stop_stream()


def test_stream_infer(
    client: tc.InferenceServerClient, native: pb_grpc.TandemStub, stream: StreamCollector
) -> None:
    expected = native_text(native, PROMPT, 24)
    client.async_stream_infer(MODEL_NAME, llm_inputs(max_tokens=24, stream=True, exclude_input=True),
                              request_id="s-1")
    responses = stream.until_final()
    assert len(responses) > 1
    assert "".join(text_output(r) for r in responses) == expected
    assert all(not is_final(r) for r in responses[:-1])
    assert all(r.get_response().id == "s-1" for r in responses)
    final = responses[-1].get_response().parameters["triton_final_response"]
    assert final.WhichOneof("parameter_choice") == "bool_param" and final.bool_param is True

    # without exclude_input_in_output the first response starts with the prompt
    client.async_stream_infer(MODEL_NAME, llm_inputs(max_tokens=24, stream=True), request_id="s-2")
    responses = stream.until_final()
    assert text_output(responses[0]).startswith(PROMPT)
    assert "".join(text_output(r) for r in responses) == PROMPT + expected


def test_stream_infer_without_stream_flag(
    client: tc.InferenceServerClient, native: pb_grpc.TandemStub, stream: StreamCollector
) -> None:
    """On the stream, stream=false means one response with the whole text, marked final."""
    expected = native_text(native, PROMPT, 12)
    client.async_stream_infer(MODEL_NAME, llm_inputs(max_tokens=12, exclude_input=True))
    responses = stream.until_final()
    assert len(responses) == 1
    assert text_output(responses[0]) == expected


def test_stream_error_then_next_request(
    client: tc.InferenceServerClient, native: pb_grpc.TandemStub, stream: StreamCollector
) -> None:
    client.async_stream_infer(MODEL_NAME, llm_inputs(max_tokens=8, stream=True, sampling={"temperature": -1}))
    result, error = stream.get()
    assert result is None
    assert isinstance(error, InferenceServerException)
    assert "temperature" in error.message()

    client.async_stream_infer(MODEL_NAME, llm_inputs(None, max_tokens=8, stream=True))
    result, error = stream.get()
    assert result is None and "text_input" in error.message()

    # the stream is still up and serves the next request
    expected = native_text(native, PROMPT, 10)
    client.async_stream_infer(MODEL_NAME, llm_inputs(max_tokens=10, stream=True, exclude_input=True))
    responses = stream.until_final()
    assert "".join(text_output(r) for r in responses) == expected


def test_stream_concurrent_requests(
    client: tc.InferenceServerClient, native: pb_grpc.TandemStub, stream: StreamCollector
) -> None:
    """Requests on one stream run concurrently; their responses are told apart by id."""
    prompts = {f"r{i}": f"Story number {i}: once" for i in range(3)}
    for rid, prompt in prompts.items():
        inputs = llm_inputs(prompt, max_tokens=16, stream=True, exclude_input=True)
        client.async_stream_infer(MODEL_NAME, inputs, request_id=rid)
    texts: dict[str, str] = {rid: "" for rid in prompts}
    finished: set[str] = set()
    while finished != set(prompts):
        result, error = stream.get()
        assert error is None, error.message()
        rid = result.get_response().id
        assert rid not in finished
        texts[rid] += text_output(result)
        if is_final(result):
            finished.add(rid)
    for rid, prompt in prompts.items():
        assert texts[rid] == native_text(native, prompt, 16)


def test_stream_cancel_frees_kv_blocks(client: tc.InferenceServerClient, native: pb_grpc.TandemStub) -> None:
    """Closing the stream with cancel_requests=True stops its generations and frees their KV blocks."""
    wait_idle(native)
    collector = StreamCollector()
    client.start_stream(callback=collector, stream_timeout=TIMEOUT)
    try:
        for i in range(2):
            inputs = llm_inputs(max_tokens=900, stream=True, sampling={"temperature": 1.0, "seed": i})
            client.async_stream_infer(MODEL_NAME, inputs, request_id=f"long-{i}")
        for _ in range(4):
            result, error = collector.get()
            assert error is None, error.message()
        load = native.GetLoad(pb.LoadRequest(), timeout=TIMEOUT)
        assert load.requests_running == 2
        assert load.kv_blocks_free < load.kv_blocks_total
    finally:
        client.stop_stream(cancel_requests=True)
    wait_idle(native)


def test_same_request_id_on_two_streams(server: str, native: pb_grpc.TandemStub) -> None:
    """A KServe request id only correlates responses on its own stream: two clients that both number
    their requests from "1" must not collide."""
    clients = [tc.InferenceServerClient(url=server) for _ in range(2)]
    collectors = [StreamCollector() for _ in clients]
    try:
        for c, collector in zip(clients, collectors, strict=True):
            c.start_stream(callback=collector, stream_timeout=TIMEOUT)
        for c in clients:
            c.async_stream_infer(MODEL_NAME, llm_inputs(max_tokens=200, stream=True, exclude_input=True),
                                 request_id="1")
        texts = []
        for collector in collectors:
            responses = collector.until_final()
            assert all(r.get_response().id == "1" for r in responses)
            texts.append("".join(text_output(r) for r in responses))
        assert texts[0] == texts[1] == native_text(native, PROMPT, 200)
    finally:
        for c in clients:
            c.stop_stream(cancel_requests=True)
            c.close()
