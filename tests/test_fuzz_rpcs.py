"""Property-based fuzzing of every RPC on a real server: random bytes to every method, and random but
well-formed requests to the generation methods of both APIs. Whatever comes in, the answer is a
documented status, no call hangs, nothing is logged as a traceback, and the server answers a good
request afterwards exactly as before.

KServe messages come from tritonclient's protos (this module must not import tandem.kserve: the two
sets define the same protobuf symbols).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverproc import ServerFactory
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MODEL_NAME = "tiny-fuzz"
CALL_TIMEOUT = 30.0  # a call still running after this is a hang
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same cases on every run: CI never meets a new one by chance
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# what a client mistake may get (docs/api.md, Errors); never UNKNOWN, INTERNAL or a hang
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

UNARY = [
    "/tandem.v1.Tandem/Generate",
    "/tandem.v1.Tandem/Tokenize",
    "/tandem.v1.Tandem/GetModelInfo",
    "/tandem.v1.Tandem/GetLoad",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ModelReady",
    "/inference.GRPCInferenceService/ServerMetadata",
    "/inference.GRPCInferenceService/ModelMetadata",
    "/inference.GRPCInferenceService/ModelConfig",
    "/inference.GRPCInferenceService/ModelInfer",
    "/grpc.health.v1.Health/Check",
]
SERVER_STREAMING = ["/tandem.v1.Tandem/GenerateStream", "/grpc.health.v1.Health/Watch"]
BIDI = [
    "/inference.GRPCInferenceService/ModelStreamInfer",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
]
FOREVER = {"/grpc.health.v1.Health/Watch"}  # answers, then stays open: one message is enough


@pytest.fixture(scope="module")
def server(serve: ServerFactory) -> tuple[str, Path]:
    live = serve("--model-name", MODEL_NAME, "--max-model-len", "64", "--num-kv-blocks", "64")
    return live.address, live.log


@pytest.fixture(scope="module")
def channel(server: tuple[str, Path]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server[0]) as ch:
        yield ch


def _reference(channel: grpc.Channel) -> str:
    req = pb.GenerateRequest(text="Once upon a time", stopping=pb.StoppingCriteria(max_tokens=12))
    return pb_grpc.TandemStub(channel).Generate(req, timeout=CALL_TIMEOUT).text


@pytest.fixture(scope="module")
def before(channel: grpc.Channel) -> str:
    return _reference(channel)


def _expect_documented(call: object) -> grpc.StatusCode:
    """Run the call; its status, which must be documented (a hang shows as DEADLINE_EXCEEDED)."""
    try:
        call()
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
    assert code in DOCUMENTED, f"{code.name}"
    return code


@FUZZ
@given(method=st.sampled_from(UNARY + SERVER_STREAMING + BIDI), raw=st.binary(max_size=300))
def test_random_bytes_to_every_method(channel: grpc.Channel, before: str, method: str, raw: bytes) -> None:
    if method in UNARY:
        rpc = channel.unary_unary(method)
        _expect_documented(lambda: rpc(raw, timeout=CALL_TIMEOUT))
    elif method in SERVER_STREAMING:
        stream = channel.unary_stream(method)(raw, timeout=CALL_TIMEOUT)
        if method in FOREVER:
            _expect_documented(lambda: (next(stream, None), stream.cancel()))
        else:
            _expect_documented(lambda: list(stream))
    else:
        replies = channel.stream_stream(method)(iter([raw, raw]), timeout=CALL_TIMEOUT)
        _expect_documented(lambda: list(replies))


_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, -1.0, 1e30, 0.5])
)
_ints32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, 80))
_token_ids = st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-1, 50000)), max_size=80)
_texts = st.text(max_size=120)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=draw(st.sampled_from(["", MODEL_NAME, "other"])))
    req.request_id = draw(st.sampled_from(["", "same", "x" * 300]))
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if kind == "text":
        req.text = draw(_texts)
    elif kind == "chat":
        req.chat.SetInParent()
        for _ in range(draw(st.integers(0, 3))):
            role = draw(st.sampled_from(["system", "user", "assistant", "tool", "robot", ""]))
            req.chat.messages.add(role=role, content=draw(_texts))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(_token_ids))
    for name in ("temperature", "top_p"):
        if draw(st.booleans()):
            setattr(req.sampling, name, draw(_floats))
    if draw(st.booleans()):
        req.sampling.top_k = draw(_ints32)
    if draw(st.booleans()):
        req.sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        req.stopping.max_tokens = draw(_ints32)
    req.stopping.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    req.stopping.stop_token_ids.extend(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)))
    req.stopping.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        req.logprobs.enabled = draw(st.booleans())
        req.logprobs.top_logprobs = draw(_ints32)
    return req


@FUZZ
@given(req=generate_requests(), stream=st.booleans())
def test_random_native_requests(
    channel: grpc.Channel, before: str, req: pb.GenerateRequest, stream: bool
) -> None:
    stub = pb_grpc.TandemStub(channel)
    if stream:
        _expect_documented(lambda: list(stub.GenerateStream(req, timeout=CALL_TIMEOUT)))
    else:
        _expect_documented(lambda: stub.Generate(req, timeout=CALL_TIMEOUT))
    tokenize = pb.TokenizeRequest(model=req.model, add_special_tokens=req.stopping.ignore_eos)
    if req.HasField("chat"):
        tokenize.chat.CopyFrom(req.chat)
    elif req.HasField("text"):
        tokenize.text = req.text
    _expect_documented(lambda: stub.Tokenize(tokenize, timeout=CALL_TIMEOUT))


_DATATYPES = ["BYTES", "BOOL", "INT32", "INT64", "UINT32", "UINT64", "FP32", "FP16", ""]
_NAMES = ["text_input", "max_tokens", "stream", "sampling_parameters", "exclude_input_in_output", "other"]
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_sampling_json = st.one_of(
    st.dictionaries(
        st.sampled_from(["temperature", "top_p", "top_k", "seed", "stop", "max_tokens", "beam"]),
        _json_values,
        max_size=4,
    ).map(json.dumps),
    st.text(max_size=40),
)


@st.composite
def infer_requests(draw: st.DrawFn) -> kpb.ModelInferRequest:
    req = kpb.ModelInferRequest(model_name=draw(st.sampled_from([MODEL_NAME, "", "other"])))
    req.model_version = draw(st.sampled_from(["", "1", "x"]))
    req.id = draw(st.sampled_from(["", "same", "r1"]))
    raw_form = draw(st.booleans())
    for _ in range(draw(st.integers(0, 4))):
        name, datatype = draw(st.sampled_from(_NAMES)), draw(st.sampled_from(_DATATYPES))
        tensor = req.inputs.add(name=name, datatype=datatype)
        tensor.shape.extend(draw(st.lists(st.integers(-2, 3), max_size=2)))
        if name == "sampling_parameters" and datatype == "BYTES" and not raw_form:
            tensor.contents.bytes_contents.append(draw(_sampling_json).encode())
        elif name == "text_input" and datatype == "BYTES" and not raw_form:
            tensor.contents.bytes_contents.extend(t.encode() for t in draw(st.lists(_texts, max_size=2)))
        elif not raw_form:
            contents = tensor.contents
            contents.int_contents.extend(draw(st.lists(_ints32, max_size=2)))
            contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=2)))
            contents.uint64_contents.extend(draw(st.lists(st.integers(0, 2**64 - 1), max_size=1)))
        if raw_form:
            req.raw_input_contents.append(draw(st.binary(max_size=40)))
    if draw(st.booleans()):
        param = req.parameters["timeout"]
        which = draw(st.sampled_from(["int64", "string", "bool"]))
        if which == "int64":
            param.int64_param = draw(st.integers(-(2**63), 2**63 - 1))
        elif which == "string":
            param.string_param = draw(st.text(max_size=10))
        else:
            param.bool_param = draw(st.booleans())
    return req


@FUZZ
@given(req=infer_requests())
def test_random_kserve_requests(channel: grpc.Channel, before: str, req: kpb.ModelInferRequest) -> None:
    stub = kpb_grpc.GRPCInferenceServiceStub(channel)
    _expect_documented(lambda: stub.ModelInfer(req, timeout=CALL_TIMEOUT))


@settings(FUZZ, max_examples=40)
@given(reqs=st.lists(infer_requests(), min_size=1, max_size=4))
def test_random_kserve_streams_answer_each_request(
    channel: grpc.Channel, before: str, reqs: list[kpb.ModelInferRequest]
) -> None:
    """A decoupled stream reports each bad request (`error_message`) and goes on to the next."""
    stub = kpb_grpc.GRPCInferenceServiceStub(channel)
    replies: list[kpb.ModelStreamInferResponse] = []
    code = _expect_documented(lambda: replies.extend(stub.ModelStreamInfer(iter(reqs), timeout=CALL_TIMEOUT)))
    assert code == grpc.StatusCode.OK
    answered = sum(1 for r in replies if r.error_message or _final(r))
    assert answered == len(reqs), [r.error_message for r in replies]


def _final(reply: kpb.ModelStreamInferResponse) -> bool:
    params = reply.infer_response.parameters
    return "triton_final_response" not in params or params["triton_final_response"].bool_param


def test_zz_the_server_is_unharmed(channel: grpc.Channel, server: tuple[str, Path], before: str) -> None:
    """Runs after the fuzz tests (file order): same greedy answer, every block free, no traceback."""
    assert _reference(channel) == before
    load = pb_grpc.TandemStub(channel).GetLoad(pb.LoadRequest(), timeout=CALL_TIMEOUT)
    assert load.kv_blocks_free == load.kv_blocks_total and load.requests_running == 0
    text = server[1].read_text()
    assert "Traceback" not in text, text[text.find("Traceback") - 2000 : text.find("Traceback") + 3000]
