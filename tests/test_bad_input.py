"""Every malformed request gets its precise gRPC status and a message naming the offending field,
and the server goes on serving: the next good request succeeds, and at the end the process is
alive and SERVING.

The server runs the tiny llama model with small limits so that each limit is cheap to cross.
As in test_kserve_api, tritonclient is the KServe client, so `tandem.kserve` is never imported here.
"""

from __future__ import annotations

import math
import queue
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerFactory

if "tandem.kserve.grpc_service_pb2" in sys.modules:  # pragma: no cover - a guard for the whole suite
    raise ImportError("tandem.kserve is imported in this process; tritonclient's protos would clash with it")

import tritonclient.grpc as tc  # noqa: E402
from tritonclient.grpc import service_pb2 as kpb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as kpb_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tandem.v1 import tandem_pb2 as pb  # noqa: E402
from tandem.v1 import tandem_pb2_grpc as pb_grpc  # noqa: E402

MODEL_NAME = "tiny-bad"
MAX_MODEL_LEN = 64
MAX_MESSAGE_BYTES = 16 * 1024
MAX_STOP_STRINGS = 4
TIMEOUT = 30.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PROMPT = "Hello there"


@dataclass
class Server:
    address: str
    proc: subprocess.Popen
    native: pb_grpc.TandemStub
    kserve: tc.InferenceServerClient
    kserve_raw: kpb_grpc.GRPCInferenceServiceStub
    vocab_size: int
    log: Path


@pytest.fixture(scope="module")
def server(serve: ServerFactory) -> Iterator[Server]:
    live = serve(
        "--model-name", MODEL_NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        "--max-stop-strings", str(MAX_STOP_STRINGS),
        "--num-kv-blocks", "64",
    )  # fmt: skip
    with grpc.insecure_channel(live.address) as channel:
        native = pb_grpc.TandemStub(channel)
        kserve = tc.InferenceServerClient(url=live.address)
        vocab = native.GetModelInfo(pb.ModelInfoRequest(), timeout=TIMEOUT).vocab_size
        try:
            raw = kpb_grpc.GRPCInferenceServiceStub(channel)
            yield Server(live.address, live.proc, native, kserve, raw, vocab, live.log)
        finally:
            kserve.close()


# -- native API ---------------------------------------------------------------------------------


def gen(
    text: str | None = PROMPT,
    *,
    max_tokens: int | None = 4,
    sampling: dict | None = None,
    **stopping: object,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**(sampling or {})))
    if text is not None:
        req.text = text
    if max_tokens is not None:
        req.stopping.max_tokens = max_tokens
    for key, value in stopping.items():
        if isinstance(value, list):
            getattr(req.stopping, key).extend(value)
        else:
            setattr(req.stopping, key, value)
    return req


def with_token_ids(ids: list[int], max_tokens: int | None = 1) -> pb.GenerateRequest:
    req = gen(None, max_tokens=max_tokens)
    req.token_ids.SetInParent()  # set the oneof even when ids is empty
    req.token_ids.ids.extend(ids)
    return req


def with_chat(messages: list[pb.ChatMessage]) -> pb.GenerateRequest:
    req = gen(None)
    req.chat.SetInParent()
    req.chat.messages.extend(messages)
    return req


def with_logprobs(top: int) -> pb.GenerateRequest:
    req = gen()
    req.logprobs.enabled = True
    req.logprobs.top_logprobs = top
    return req


def with_model(name: str) -> pb.GenerateRequest:
    req = gen()
    req.model = name
    return req


# (id, request factory taking the vocab size, expected status, words the details must contain)
NativeCase = tuple[str, Callable[[int], pb.GenerateRequest], grpc.StatusCode, tuple[str, ...]]
LONG_TEXT = "one two three four five six seven eight nine ten " * 10  # > MAX_MODEL_LEN tokens

NATIVE_CASES: list[NativeCase] = [
    ("empty-text", lambda v: gen(""), INVALID, ("prompt", "empty")),
    ("empty-token-ids", lambda v: with_token_ids([]), INVALID, ("prompt", "empty")),
    ("no-input", lambda v: gen(None), INVALID, ("input",)),
    ("prompt-longer-than-context", lambda v: gen(LONG_TEXT, max_tokens=None), INVALID,
     ("prompt", "context length", str(MAX_MODEL_LEN))),
    ("prompt-fills-context", lambda v: with_token_ids([100] * MAX_MODEL_LEN), INVALID,
     ("prompt", str(MAX_MODEL_LEN))),
    ("prompt-plus-max-tokens-past-context", lambda v: with_token_ids([100] * (MAX_MODEL_LEN - 1), 2), INVALID,
     ("max_tokens", "context length")),
    ("max-tokens-zero", lambda v: gen(max_tokens=0), INVALID, ("max_tokens", "positive")),
    ("max-tokens-negative", lambda v: gen(max_tokens=-5), INVALID, ("max_tokens", "-5")),
    ("max-tokens-absurd", lambda v: gen(max_tokens=10**9), INVALID, ("max_tokens", str(10**9))),
    ("temperature-negative", lambda v: gen(sampling={"temperature": -0.5}), INVALID, ("temperature",)),
    ("temperature-nan", lambda v: gen(sampling={"temperature": math.nan}), INVALID,
     ("temperature", "finite")),
    ("temperature-inf", lambda v: gen(sampling={"temperature": math.inf}), INVALID,
     ("temperature", "finite")),
    ("temperature-over-100", lambda v: gen(sampling={"temperature": 100.5}), INVALID, ("temperature", "100")),
    ("top-p-negative", lambda v: gen(sampling={"top_p": -0.1}), INVALID, ("top_p",)),
    ("top-p-over-one", lambda v: gen(sampling={"top_p": 1.5}), INVALID, ("top_p",)),
    ("top-p-nan", lambda v: gen(sampling={"top_p": math.nan}), INVALID, ("top_p", "finite")),
    ("top-k-negative", lambda v: gen(sampling={"top_k": -1}), INVALID, ("top_k",)),
    ("top-k-over-vocab", lambda v: gen(sampling={"top_k": v + 1}), INVALID, ("top_k", "{v}")),
    ("seed-over-int63", lambda v: gen(sampling={"seed": 2**63}), INVALID, ("seed",)),
    ("unknown-model", lambda v: with_model("no-such-model"), grpc.StatusCode.NOT_FOUND, ("no-such-model",)),
    ("token-id-negative", lambda v: with_token_ids([5, -1, 6]), INVALID, ("token id -1", "{last}")),
    ("token-id-vocab", lambda v: with_token_ids([5, v]), INVALID, ("token id {v}", "{last}")),
    ("token-id-huge", lambda v: with_token_ids([2**40]), INVALID, (f"token id {2**40}",)),
    ("stop-token-id-bad", lambda v: gen(stop_token_ids=[v]), INVALID, ("stop_token_ids", "token id {v}")),
    ("too-many-stop-strings", lambda v: gen(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), INVALID,
     ("stop strings", str(MAX_STOP_STRINGS + 1), str(MAX_STOP_STRINGS))),
    ("empty-stop-string", lambda v: gen(stop=["ok", ""]), INVALID, ("stop string", "empty")),
    ("too-long-stop-string", lambda v: gen(stop=["x" * 257]), INVALID, ("stop string", "257", "256")),
    ("top-logprobs-over-20", lambda v: with_logprobs(21), INVALID, ("top_logprobs", "20", "21")),
    ("top-logprobs-negative", lambda v: with_logprobs(-1), INVALID, ("top_logprobs",)),
    ("chat-no-messages", lambda v: with_chat([]), INVALID, ("chat", "messages")),
]


def expect_native_good(server: Server) -> None:
    resp = server.native.Generate(gen(max_tokens=3, ignore_eos=True), timeout=TIMEOUT)
    assert len(resp.token_ids) == 3
    assert resp.finish_reason == pb.FINISH_REASON_LENGTH


def check_error(err: grpc.RpcError, code: grpc.StatusCode, words: tuple[str, ...]) -> None:
    assert err.code() == code, f"{err.code()}: {err.details()}"
    for word in words:
        assert word in err.details(), f"{word!r} not in {err.details()!r}"


@pytest.mark.parametrize("case", NATIVE_CASES, ids=[c[0] for c in NATIVE_CASES])
def test_native_bad_request(server: Server, case: NativeCase) -> None:
    _, make, code, words = case
    v = server.vocab_size
    req = make(v)
    words = tuple(w.format(v=v, last=v - 1) for w in words)

    with pytest.raises(grpc.RpcError) as exc:
        server.native.Generate(req, timeout=TIMEOUT)
    check_error(exc.value, code, words)
    expect_native_good(server)

    with pytest.raises(grpc.RpcError) as exc:
        list(server.native.GenerateStream(req, timeout=TIMEOUT))
    check_error(exc.value, code, words)
    expect_native_good(server)


def test_native_limits_are_inclusive(server: Server) -> None:
    """The edge of each limit is accepted: these are not errors."""
    v = server.vocab_size
    ok = [
        with_token_ids([100] * (MAX_MODEL_LEN - 1), 1),  # prompt + max_tokens == context length
        with_token_ids([0, v - 1]),
        gen(sampling={"temperature": 100.0, "seed": 1}),
        gen(sampling={"top_p": 1.0, "top_k": v}),
        gen(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
        with_logprobs(20),
    ]
    for req in ok:
        resp = server.native.Generate(req, timeout=TIMEOUT)
        assert resp.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)


def test_native_oversized_message(server: Server) -> None:
    big = gen("a " * MAX_MESSAGE_BYTES)  # > --max-message-bytes on the wire
    with pytest.raises(grpc.RpcError) as exc:
        server.native.Generate(big, timeout=TIMEOUT)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value.details()
    expect_native_good(server)

    with pytest.raises(grpc.RpcError) as exc:
        list(server.native.GenerateStream(big, timeout=TIMEOUT))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    expect_native_good(server)


def test_native_oversized_response(server: Server) -> None:
    """A unary answer past --max-message-bytes: RESOURCE_EXHAUSTED saying why, no server traceback."""
    req = with_logprobs(20)  # 20 alternatives per token: far more bytes than the text
    req.stopping.max_tokens = MAX_MODEL_LEN - 8
    req.stopping.ignore_eos = True
    with pytest.raises(grpc.RpcError) as exc:
        server.native.Generate(req, timeout=TIMEOUT)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the server's message limit" in exc.value.details()
    streamed = list(server.native.GenerateStream(req, timeout=TIMEOUT))  # each chunk fits
    assert sum(len(r.token_ids) for r in streamed) == req.stopping.max_tokens
    expect_native_good(server)


def test_clients_choosing_the_same_request_id_never_collide(server: Server) -> None:
    """A client's request id is only echoed: two independent clients may pick the same one."""
    first = server.native.GenerateStream(_with_id("same-id", 24), timeout=TIMEOUT)
    assert next(first).request_id == "same-id"  # in flight
    second = server.native.Generate(_with_id("same-id", 6), timeout=TIMEOUT)
    assert second.request_id == "same-id" and second.usage.completion_tokens == 6
    rest = list(first)
    assert rest[-1].usage.completion_tokens == 24 and all(r.request_id == "same-id" for r in rest)
    expect_native_good(server)


def _with_id(request_id: str, max_tokens: int) -> pb.GenerateRequest:
    req = gen(max_tokens=max_tokens, ignore_eos=True)
    req.request_id = request_id
    return req


def test_tokenize_bad_requests(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        server.native.Tokenize(pb.TokenizeRequest(model="no-such-model", text="hi"), timeout=TIMEOUT)
    check_error(exc.value, grpc.StatusCode.NOT_FOUND, ("no-such-model",))
    with pytest.raises(grpc.RpcError) as exc:
        server.native.Tokenize(pb.TokenizeRequest(), timeout=TIMEOUT)
    check_error(exc.value, INVALID, ("input",))
    empty_chat = pb.TokenizeRequest()
    empty_chat.chat.SetInParent()
    with pytest.raises(grpc.RpcError) as exc:
        server.native.Tokenize(empty_chat, timeout=TIMEOUT)
    check_error(exc.value, INVALID, ("chat", "messages"))
    assert server.native.Tokenize(pb.TokenizeRequest(text="hi"), timeout=TIMEOUT).token_ids


# -- KServe -------------------------------------------------------------------------------------


def tensor(name: str, datatype: str, value: object) -> tc.InferInput:
    arr = np.array([value], dtype={"BYTES": np.object_, "BOOL": bool, "INT32": np.int32}[datatype])
    t = tc.InferInput(name, [1], datatype)
    t.set_data_from_numpy(arr)
    return t


def kinputs(prompt: str | None = PROMPT, max_tokens: int | None = 3, sampling: str | None = None) -> list:
    out = []
    if prompt is not None:
        out.append(tensor("text_input", "BYTES", prompt.encode()))
    if max_tokens is not None:
        out.append(tensor("max_tokens", "INT32", max_tokens))
    if sampling is not None:
        out.append(tensor("sampling_parameters", "BYTES", sampling.encode()))
    return out


KServeCase = tuple[str, Callable[[], list], grpc.StatusCode, tuple[str, ...]]
KSERVE_CASES: list[KServeCase] = [
    ("missing-text-input", lambda: kinputs(None), INVALID, ("text_input", "required")),
    ("empty-text-input", lambda: kinputs(""), INVALID, ("prompt", "empty")),
    ("malformed-json", lambda: kinputs(sampling='{"temperature": 0.5'), INVALID,
     ("sampling_parameters", "JSON")),
    ("json-not-object", lambda: kinputs(sampling="[1, 2]"), INVALID, ("sampling_parameters", "object")),
    ("unknown-sampling-key", lambda: kinputs(sampling='{"temprature": 0.5}'), INVALID,
     ("sampling_parameters", "temprature")),
    ("nan-temperature", lambda: kinputs(sampling='{"temperature": NaN}'), INVALID, ("temperature", "finite")),
    ("infinite-top-p", lambda: kinputs(sampling='{"top_p": Infinity}'), INVALID, ("top_p", "finite")),
    ("string-temperature", lambda: kinputs(sampling='{"temperature": "hot"}'), INVALID,
     ("temperature", "number")),
    ("negative-temperature", lambda: kinputs(sampling='{"temperature": -1}'), INVALID, ("temperature",)),
    ("fractional-top-k", lambda: kinputs(sampling='{"top_k": 2.5}'), INVALID, ("top_k", "integer")),
    ("bool-seed", lambda: kinputs(sampling='{"seed": true}'), INVALID, ("seed", "integer")),
    ("stop-not-strings", lambda: kinputs(sampling='{"stop": [1, 2]}'), INVALID, ("stop",)),
    ("max-tokens-zero", lambda: kinputs(max_tokens=0), INVALID, ("max_tokens", "positive")),
    ("max-tokens-in-json-absurd", lambda: kinputs(max_tokens=None, sampling='{"max_tokens": 1000000000}'),
     INVALID, ("max_tokens",)),
    ("prompt-longer-than-context", lambda: kinputs(LONG_TEXT, max_tokens=None), INVALID,
     ("prompt", "context length")),
    ("unknown-input", lambda: [*kinputs(), tensor("temperature", "BYTES", b"0.5")], INVALID,
     ("unknown inputs", "temperature")),
    # each input in its own datatype, once
    ("max-tokens-as-bytes", lambda: [*kinputs(max_tokens=None), tensor("max_tokens", "BYTES", b"5")],
     INVALID, ("max_tokens", "BYTES")),
    ("max-tokens-as-bool", lambda: [*kinputs(max_tokens=None), tensor("max_tokens", "BOOL", True)], INVALID,
     ("max_tokens", "BOOL")),
    ("sampling-parameters-as-int32", lambda: [*kinputs(), tensor("sampling_parameters", "INT32", 5)],
     INVALID, ("sampling_parameters", "INT32")),
    ("sampling-parameters-as-bool", lambda: [*kinputs(), tensor("sampling_parameters", "BOOL", True)],
     INVALID, ("sampling_parameters", "BOOL")),
    ("text-input-as-int32", lambda: [tensor("text_input", "INT32", 5)], INVALID, ("text_input", "INT32")),
    ("text-input-twice", lambda: [*kinputs(), tensor("text_input", "BYTES", b"again")], INVALID,
     ("text_input", "twice")),
    # numbers of any size, JSON of any depth
    *[(f"400-digit-{key}", lambda key=key: kinputs(max_tokens=None, sampling=f'{{"{key}": {"9" * 400}}}'),
       INVALID, (key,)) for key in ("temperature", "top_p", "top_k", "seed", "max_tokens")],
    ("json-deep-array", lambda: kinputs(sampling="[" * 15000), INVALID, ("sampling_parameters",)),
    ("json-deep-object", lambda: kinputs(sampling='{"a": ' * 2000 + "1" + "}" * 2000), INVALID,
     ("sampling_parameters",)),
]


def test_kserve_stream_survives_a_message_that_is_not_protobuf(server: Server) -> None:
    """The stream ends with INVALID_ARGUMENT at once, not at the client's deadline."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw,
        )
        with pytest.raises(grpc.RpcError) as exc:
            list(call(iter([b"\xff\xff\xff\xff"]), timeout=TIMEOUT))
    check_error(exc.value, INVALID, ("malformed",))
    expect_kserve_good(server)


def expect_kserve_good(server: Server) -> None:
    result = server.kserve.infer(MODEL_NAME, kinputs(), client_timeout=TIMEOUT)
    assert result.as_numpy("text_output")[0].decode().startswith(PROMPT)


@pytest.mark.parametrize("case", KSERVE_CASES, ids=[c[0] for c in KSERVE_CASES])
def test_kserve_bad_request(server: Server, case: KServeCase) -> None:
    _, make, code, words = case
    with pytest.raises(InferenceServerException) as exc:
        server.kserve.infer(MODEL_NAME, make(), client_timeout=TIMEOUT)
    assert exc.value.status() == str(code), exc.value.message()
    for word in words:
        assert word in exc.value.message(), f"{word!r} not in {exc.value.message()!r}"
    expect_kserve_good(server)


def raw_request(**fields: object) -> kpb.ModelInferRequest:
    return kpb.ModelInferRequest(model_name=MODEL_NAME, **fields)


def bytes_tensor(name: str, shape: list[int] | None = None) -> kpb.ModelInferRequest.InferInputTensor:
    return kpb.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=shape or [1])


def raw_elements(*items: bytes) -> bytes:
    return b"".join(len(x).to_bytes(4, "little") + x for x in items)


RAW_CASES = [
    ("raw-count-mismatch",
     raw_request(inputs=[bytes_tensor("text_input"), bytes_tensor("sampling_parameters")],
                 raw_input_contents=[raw_elements(b"hi")]),
     ("raw_input_contents",)),
    ("raw-truncated-length",
     raw_request(inputs=[bytes_tensor("text_input")], raw_input_contents=[b"\x05\x00"]),
     ("BYTES", "truncated")),
    ("raw-element-past-end",
     raw_request(inputs=[bytes_tensor("text_input")], raw_input_contents=[b"\x09\x00\x00\x00abc"]),
     ("BYTES", "past the end")),
    ("two-prompts",
     raw_request(inputs=[bytes_tensor("text_input", [2])], raw_input_contents=[raw_elements(b"a", b"b")]),
     ("text_input", "one element")),
    ("fp32-datatype",
     raw_request(inputs=[kpb.ModelInferRequest.InferInputTensor(name="max_tokens", datatype="FP32",
                                                                 shape=[1]),
                         bytes_tensor("text_input")],
                 raw_input_contents=[b"\x00\x00\x80\x3f", raw_elements(b"hi")]),
     ("max_tokens", "FP32")),
    ("invalid-utf8",
     raw_request(inputs=[bytes_tensor("text_input")], raw_input_contents=[raw_elements(b"\xff\xfe")]),
     ("text_input", "UTF-8")),
    ("unknown-model",
     kpb.ModelInferRequest(model_name="no-such-model", inputs=[bytes_tensor("text_input")],
                           raw_input_contents=[raw_elements(b"hi")]),
     ("no-such-model",)),
]


@pytest.mark.parametrize("case", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_kserve_malformed_tensors(server: Server, case: tuple) -> None:
    name, req, words = case
    with pytest.raises(grpc.RpcError) as exc:
        server.kserve_raw.ModelInfer(req, timeout=TIMEOUT)
    code = grpc.StatusCode.NOT_FOUND if name == "unknown-model" else INVALID
    check_error(exc.value, code, words)
    expect_kserve_good(server)


def test_kserve_oversized_message(server: Server) -> None:
    with pytest.raises(InferenceServerException) as exc:
        server.kserve.infer(MODEL_NAME, kinputs("a " * MAX_MESSAGE_BYTES), client_timeout=TIMEOUT)
    assert exc.value.status() == "StatusCode.RESOURCE_EXHAUSTED", exc.value.message()
    expect_kserve_good(server)


def test_kserve_stream_bad_requests_keep_the_stream(server: Server) -> None:
    """Each bad request on a stream gets its error in the callback; the stream serves on."""
    got: queue.Queue = queue.Queue()
    server.kserve.start_stream(
        callback=lambda result, error: got.put((result, error)), stream_timeout=TIMEOUT
    )
    try:
        for name, make, _code, words in KSERVE_CASES:
            server.kserve.async_stream_infer(MODEL_NAME, make(), request_id=name)
            result, error = got.get(timeout=TIMEOUT)
            assert result is None and error is not None, name
            for word in words:
                assert word in error.message(), f"{name}: {word!r} not in {error.message()!r}"
        server.kserve.async_stream_infer(MODEL_NAME, kinputs(), request_id="good")
        result, error = got.get(timeout=TIMEOUT)
        assert error is None, error.message()
        assert result.get_response().id == "good"
        assert result.as_numpy("text_output")[0].decode().startswith(PROMPT)
    finally:
        server.kserve.stop_stream()


# -- not protobuf at all -------------------------------------------------------------------------

UNARY_METHODS = [
    "/tandem.v1.Tandem/Generate", "/tandem.v1.Tandem/Tokenize", "/tandem.v1.Tandem/GetModelInfo",
    "/tandem.v1.Tandem/GetLoad", "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/ModelMetadata", "/inference.GRPCInferenceService/ServerLive",
    "/grpc.health.v1.Health/Check",
]  # fmt: skip
GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab"]  # not a tag; a field past the end: no type parses them


@pytest.mark.parametrize("method", UNARY_METHODS)
def test_a_message_that_is_not_protobuf_is_invalid_argument(server: Server, method: str) -> None:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(method, request_serializer=lambda r: r, response_deserializer=lambda r: r)
        for body in GARBAGE:
            with pytest.raises(grpc.RpcError) as exc:
                call(body, timeout=TIMEOUT)
            check_error(exc.value, INVALID, ("malformed request",))
    stream = grpc.insecure_channel(server.address).unary_stream(
        "/tandem.v1.Tandem/GenerateStream", request_serializer=lambda r: r, response_deserializer=lambda r: r
    )
    with pytest.raises(grpc.RpcError) as exc:
        list(stream(GARBAGE[0], timeout=TIMEOUT))
    check_error(exc.value, INVALID, ("malformed request",))
    expect_native_good(server)


def test_a_prompt_too_long_for_any_tokens_is_refused_before_tokenizing(server: Server) -> None:
    """MAX_MODEL_LEN tokens of at most the vocabulary's longest token: more characters cannot fit."""
    text = "x" * (MAX_MESSAGE_BYTES // 2)
    with pytest.raises(grpc.RpcError) as exc:
        server.native.Generate(gen(text, max_tokens=None), timeout=TIMEOUT)
    check_error(exc.value, INVALID, ("characters", "context length", str(MAX_MODEL_LEN)))
    chat = with_chat([pb.ChatMessage(role="user", content=text)])
    with pytest.raises(grpc.RpcError) as exc:
        server.native.Generate(chat, timeout=TIMEOUT)
    check_error(exc.value, INVALID, ("chat", "characters"))
    expect_native_good(server)


def test_the_log_has_no_traceback(server: Server) -> None:
    """Every bad request above got its status and no traceback (a malformed one: one warning a minute)."""
    text = server.log.read_text()
    assert "Traceback" not in text, text[text.index("Traceback") - 500 :][:3000]
    assert text.count("malformed request on") <= 2


# -- still alive --------------------------------------------------------------------------------


def test_server_survived_everything(server: Server) -> None:
    """Runs last in this module: after every bad request above, the process is up and SERVING."""
    assert server.proc.poll() is None
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tandem.v1.Tandem", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service
    expect_native_good(server)
    expect_kserve_good(server)
    load = server.native.GetLoad(pb.LoadRequest(), timeout=TIMEOUT)
    assert load.requests_running == 0 and load.requests_waiting == 0
    assert load.kv_blocks_free == load.kv_blocks_total

