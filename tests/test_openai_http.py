"""The OpenAI-compatible HTTP front of a real `tandem serve`, asked by the published `openai` client
and by raw HTTP (http.client, sockets), and checked against the native gRPC API of the same server.

The session's tiny server (conftest.tiny_server, the tiny random llama with its HTTP port on) serves
the module: greedy output of a random model is deterministic, which is all these tests need.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverproc import TINY_SERVER_KV_BLOCKS, TINY_SERVER_MODEL, wait_idle

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

TIMEOUT = 60.0
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours."},
]
NO_EOS = {"ignore_eos": True}  # the extension: every request runs to max_tokens


@pytest.fixture(scope="module")
def base_url(tiny_server_http: str) -> str:
    return tiny_server_http


@pytest.fixture(scope="module")
def client(tiny_openai: openai.OpenAI) -> openai.OpenAI:
    return tiny_openai


@pytest.fixture(scope="module")
def stub(tiny_server: str) -> Iterator[pb_grpc.TandemStub]:
    with grpc.insecure_channel(tiny_server) as channel:
        yield pb_grpc.TandemStub(channel)


# -- helpers ------------------------------------------------------------------------------------


def native(stub: pb_grpc.TandemStub, max_tokens: int, chat: bool = False, **kwargs) -> pb.GenerateResponse:
    req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True), **kwargs)
    if chat:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in CHAT)
    else:
        req.text = PROMPT
    return stub.Generate(req, timeout=TIMEOUT)


def post(
    base_url: str, path: str, body: bytes | dict, headers: dict | None = None
) -> http.client.HTTPResponse:
    """A raw POST; the response is read by the caller (its status whatever it is)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(urlsplit(base_url).netloc, timeout=TIMEOUT)
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def events(resp: http.client.HTTPResponse) -> list[bytes]:
    """The raw SSE events of a streamed response, each checked to be one `data: ...` line."""
    raw = resp.read()
    assert raw.endswith(b"\n\n"), raw[-50:]
    out = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in out), out
    return [e.removeprefix(b"data: ") for e in out]


def chat_text(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str | None, object]:
    """(text, finish_reason, usage) of a chat completion, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=TINY_SERVER_MODEL, messages=CHAT, **kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    chunks = list(
        client.chat.completions.create(
            model=TINY_SERVER_MODEL,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, finish[0], chunks[-1].usage


def completion_text(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str | None, object]:
    if not stream:
        r = client.completions.create(model=TINY_SERVER_MODEL, prompt=PROMPT, **kwargs)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    chunks = list(
        client.completions.create(
            model=TINY_SERVER_MODEL,
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, finish[0], chunks[-1].usage


# -- models and probes --------------------------------------------------------------------------


def test_models_health_and_readiness(client: openai.OpenAI, base_url: str) -> None:
    (model,) = client.models.list().data
    assert model.id == TINY_SERVER_MODEL and model.owned_by == "tandem"
    assert client.models.retrieve(TINY_SERVER_MODEL).id == TINY_SERVER_MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"
    for path in ("/health", "/ready"):
        conn = http.client.HTTPConnection(urlsplit(base_url).netloc, timeout=TIMEOUT)
        conn.request("GET", path)
        assert conn.getresponse().status == 200


# -- the tokenizer's files ------------------------------------------------------------------------


def http_get(base_url: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(urlsplit(base_url).netloc, timeout=TIMEOUT)
    conn.request("GET", path)
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_the_fetched_tokenizer_tokenizes_as_the_server(
    client: openai.OpenAI, base_url: str, stub: pb_grpc.TandemStub, tmp_path: Path
) -> None:
    """`tandem tokenizer` writes the files /v1/models names; AutoTokenizer loads them, and counts tokens
    as the server's Tokenize does, for a text and for a chat through the chat template."""
    from transformers import AutoTokenizer

    card = client.models.retrieve(TINY_SERVER_MODEL).model_extra["tokenizer"]
    assert card["url"] == f"/v1/models/{TINY_SERVER_MODEL}/tokenizer"
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(card["files"])
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=TIMEOUT)
    assert list(info.tokenizer_files) == card["files"]
    assert json.loads(http_get(base_url, card["url"])[1]) == card

    folder = tmp_path / "tokenizer"
    cmd = [sys.executable, "-m", "tandem.cli", "tokenizer", str(folder), "--server", base_url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd="/",
                          env={**os.environ, "PYTHONSAFEPATH": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == card["files"]

    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text in (PROMPT, "naïve café, 東京 🚀"):
        served = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=True), timeout=TIMEOUT)
        assert tokenizer.encode(text) == list(served.token_ids)
    chat = pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT]))
    served = stub.Tokenize(chat, timeout=TIMEOUT)
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert list(ids["input_ids"] if hasattr(ids, "keys") else ids) == list(served.token_ids)


@pytest.mark.parametrize(
    "file",
    ["config.json", "model.safetensors", "../config.json", "..%2Fconfig.json", "%2e%2e/config.json",
     "/etc/passwd", "./tokenizer.json", "tokenizer.json/", "additional_chat_templates/../config.json"],
)  # fmt: skip
def test_only_the_tokenizer_s_own_files_are_served(base_url: str, file: str) -> None:
    """The model's weights and config are in the same folder: a name that is not one of the tokenizer's
    files, or a path that would lead elsewhere, is 404 with an OpenAI error body."""
    status, body = http_get(base_url, f"/v1/models/{TINY_SERVER_MODEL}/tokenizer/{file}")
    assert status == 404, body[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "not_found" and "is not a file of the tokenizer" in error["message"]


def test_another_model_s_tokenizer_is_not_found(base_url: str) -> None:
    status, body = http_get(base_url, "/v1/models/no-such-model/tokenizer/tokenizer.json")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


# -- generation against the native API ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_greedy_text_equals_the_native_apis(
    client: openai.OpenAI, stub: pb_grpc.TandemStub, kind: str, stream: bool
) -> None:
    ask = chat_text if kind == "chat" else completion_text
    text, finish, usage = ask(client, stream, max_tokens=20, temperature=0, extra_body=NO_EOS)
    reference = native(stub, 20, chat=kind == "chat")
    assert text == reference.text and text
    assert finish == "length"
    assert usage.prompt_tokens == reference.usage.prompt_tokens
    assert usage.completion_tokens == 20 and usage.total_tokens == usage.prompt_tokens + 20


def test_token_id_prompt_and_max_completion_tokens(client: openai.OpenAI, stub: pb_grpc.TandemStub) -> None:
    ids = list(
        stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True), timeout=TIMEOUT).token_ids
    )
    by_ids = client.completions.create(
        model=TINY_SERVER_MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    assert by_ids.choices[0].text == native(stub, 12).text
    chat = client.chat.completions.create(
        model=TINY_SERVER_MODEL, messages=CHAT, max_completion_tokens=5, max_tokens=50, extra_body=NO_EOS
    )
    assert chat.usage.completion_tokens == 5  # the newer name wins


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_strings_end_the_text_before_them(
    client: openai.OpenAI, stub: pb_grpc.TandemStub, base_url: str, stream: bool
) -> None:
    full = native(stub, 32).text
    k = next(
        i for i in range(len(full) // 3, len(full) - 2)
        if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2] and full.find(full[i : i + 2]) > 0
    )  # fmt: skip
    stop = full[k : k + 2]
    text, finish, _ = completion_text(
        client, stream, max_tokens=32, temperature=0, stop=[stop, "never-there"], extra_body=NO_EOS
    )
    assert text == full[: full.find(stop)] and finish == "stop"
    body = json.loads(post(base_url, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 32, "temperature": 0,
                                                   "stop": stop, "ignore_eos": True}).read())  # fmt: skip
    assert body["choices"][0]["stop_reason"] == stop  # vLLM's extension: which one it was


def test_seeded_sampling_is_reproducible_and_matches_native(client: openai.OpenAI, stub: pb_grpc.TandemStub):
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=TINY_SERVER_MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            extra_body=NO_EOS,
        )
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    seeded = native(stub, 24, sampling=pb.SamplingParams(temperature=1.0, seed=1234))
    assert seeded.text == first


def test_top_p_zero_is_greedy_as_openai_reads_it(client: openai.OpenAI, stub: pb_grpc.TandemStub) -> None:
    """top_p 0 keeps the likeliest token alone: whatever the temperature and seed, the greedy answer."""
    for seed in (1, 2):
        r = client.completions.create(
            model=TINY_SERVER_MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0, seed=seed,
            extra_body=NO_EOS,
        )
        assert r.choices[0].text == native(stub, 16).text
    sampled = native(stub, 16, sampling=pb.SamplingParams(temperature=1.0, top_p=0.0, seed=5))
    assert sampled.text == native(stub, 16).text  # the native API reads it so too


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_prompt_past_the_context_is_context_length_exceeded(client: openai.OpenAI, kind: str) -> None:
    """OpenAI's error for a prompt the context cannot hold: code context_length_exceeded, on the field
    that holds the prompt, with the numbers that matter and no word of max_tokens."""
    long = "hello " * 2000  # the tiny model's context is 1,024 tokens
    with pytest.raises(openai.BadRequestError) as exc:
        if kind == "chat":
            messages = [{"role": "user", "content": long}]
            client.chat.completions.create(model=TINY_SERVER_MODEL, messages=messages)
        else:
            client.completions.create(model=TINY_SERVER_MODEL, prompt=long)
    error = exc.value.body
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == ("messages" if kind == "chat" else "prompt")
    assert "max_tokens" not in error["message"] and " -" not in error["message"], error["message"]
    with pytest.raises(openai.BadRequestError) as exc:  # a prompt that fits, with too many new tokens
        client.completions.create(model=TINY_SERVER_MODEL, prompt=PROMPT, max_tokens=5000)
    assert (exc.value.body["code"], exc.value.body["param"]) == ("context_length_exceeded", "max_tokens")


def test_a_stop_token_id_is_the_stop_reason(client: openai.OpenAI, stub: pb_grpc.TandemStub) -> None:
    """A stop_token_id that ends the answer is its stop_reason (vLLM's extension); its text is not sent."""
    ids = list(native(stub, 12).token_ids)
    stop_id = ids[5]
    r = client.completions.create(
        model=TINY_SERVER_MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={**NO_EOS, "stop_token_ids": [stop_id], "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    assert choice.model_extra["token_ids"] == ids[: ids.index(stop_id) + 1]


def test_unset_temperature_samples_as_openai_does(client: openai.OpenAI, stub: pb_grpc.TandemStub) -> None:
    """OpenAI's default temperature is 1, not the native API's greedy: a seed makes it reproducible."""
    r = client.completions.create(
        model=TINY_SERVER_MODEL, prompt=PROMPT, max_tokens=24, seed=99, extra_body=NO_EOS
    )
    assert r.choices[0].text == native(stub, 24, sampling=pb.SamplingParams(temperature=1.0, seed=99)).text
    assert r.choices[0].text != native(stub, 24).text


def test_chat_logprobs_match_the_native_ones(
    client: openai.OpenAI, stub: pb_grpc.TandemStub, tokenizer
) -> None:
    r = client.chat.completions.create(
        model=TINY_SERVER_MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
        extra_body=NO_EOS,
    )  # fmt: skip
    reference = native(stub, 8, chat=True, logprobs=pb.LogprobsOptions(enabled=True, top_logprobs=3))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry, ref, tid in zip(content, reference.logprobs, reference.token_ids, strict=True):
        assert entry.token == tokenizer.decode([tid])  # OpenAI names a token by its text
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [t.logprob for t in ref.top_logprobs], abs=1e-4
        )
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
    streamed = client.chat.completions.create(
        model=TINY_SERVER_MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, stream=True,
        extra_body=NO_EOS,
    )  # fmt: skip
    tokens = [e for c in streamed for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [e.logprob for e in tokens] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert all(e.top_logprobs == [] for e in tokens)  # logprobs without top_logprobs
    plain = client.chat.completions.create(model=TINY_SERVER_MODEL, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(client: openai.OpenAI, stub: pb_grpc.TandemStub) -> None:
    r = client.completions.create(
        model=TINY_SERVER_MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    lp = r.choices[0].logprobs
    reference = native(stub, 6, logprobs=pb.LogprobsOptions(enabled=True, top_logprobs=2))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.token_logprobs == pytest.approx([x.logprob for x in reference.logprobs], abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-4)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # fmt: skip
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("llama"))


# -- the wire: SSE framing, ids ------------------------------------------------------------------


def test_sse_framing_ids_and_usage_chunk(base_url: str, stub: pb_grpc.TandemStub) -> None:
    body = {"model": TINY_SERVER_MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **NO_EOS, "return_token_ids": True}  # fmt: skip
    resp = post(base_url, "/v1/chat/completions", body, {"X-Request-Id": "req-42"})
    assert resp.status == 200
    assert resp.getheader("content-type").startswith("text/event-stream")
    assert resp.getheader("x-request-id") == "req-42"
    raw = events(resp)
    assert raw[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in raw[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-req-42"}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == TINY_SERVER_MODEL for c in chunks)
    *content, last = chunks
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["usage"] is None for c in content)  # every chunk but the last, as OpenAI's
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    ids = [t for c in content for t in c["choices"][0]["token_ids"]]
    assert ids == list(native(stub, 6, chat=True).token_ids)
    plain = post(base_url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True})
    chunks = [json.loads(e) for e in events(plain)[:-1]]
    assert all("usage" not in c for c in chunks)  # no usage chunk unless asked
    assert chunks[0]["id"].startswith("cmpl-") and chunks[0]["object"] == "text_completion"
    assert plain.getheader("x-request-id") == chunks[0]["id"].removeprefix("cmpl-")  # a fresh one, echoed


# -- bad input ----------------------------------------------------------------------------------

CHAT_PATH, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
M = {"messages": [{"role": "user", "content": "hi"}]}
BAD = [  # (path, body, status, param)
    (CHAT_PATH, b'{"messages": [', 400, None),  # malformed JSON
    (CHAT_PATH, b"[1, 2]", 400, None),  # not an object
    (CHAT_PATH, b"\xff\xfe{}", 400, None),  # not UTF-8
    (CHAT_PATH, b"[" * 5000 + b"]" * 5000, 400, None),  # nested too deeply
    (CHAT_PATH, {}, 400, "messages"),
    (CHAT_PATH, {"messages": "hi"}, 400, "messages"),
    (CHAT_PATH, {"messages": []}, 400, "messages"),
    (CHAT_PATH, {**M, "temperature": "hot"}, 400, "temperature"),
    (CHAT_PATH, {**M, "temperature": -1}, 400, "temperature"),
    (CHAT_PATH, {**M, "top_p": -0.1}, 400, "top_p"),
    (CHAT_PATH, {**M, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT_PATH, {**M, "max_tokens": 10**6}, 400, "max_tokens"),
    (CHAT_PATH, {**M, "max_tokens": 2.5}, 400, "max_tokens"),
    (CHAT_PATH, {**M, "seed": 10**30}, 400, "seed"),
    (CHAT_PATH, {**M, "n": 2}, 400, "n"),
    (CHAT_PATH, {**M, "stop": [""]}, 400, "stop"),
    (CHAT_PATH, {**M, "stop": 5}, 400, "stop"),
    (CHAT_PATH, {**M, "top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
    (CHAT_PATH, {**M, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT_PATH, {**M, "presence_penalty": 0.5}, 400, "presence_penalty"),
    (CHAT_PATH, {**M, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (CHAT_PATH, {**M, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "messages.0.content"),
    (CHAT_PATH, {**M, "model": "gpt-4o"}, 404, "model"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "top_logprobs"),
    (CHAT_PATH, {**M, "prompt_logprobs": 1}, 400, "prompt_logprobs"),  # completions only
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": M["messages"]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "x", "stream": True, "max_tokens": 0}, 400, "max_tokens"),  # before the stream
    ("/v1/embeddings", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_an_openai_error_and_the_next_request_succeeds(
    base_url: str, path: str, body: bytes | dict, status: int, param: str | None
) -> None:
    resp = post(base_url, path, body)  # json.dumps writes a NaN as NaN, as some clients do
    answer = json.loads(resp.read())
    assert resp.status == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    if status == 404 and param == "model":
        assert error["code"] == "model_not_found"
    ok = post(base_url, COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 2})
    assert ok.status == 200 and json.loads(ok.read())["usage"]["completion_tokens"] <= 2


def test_body_size_method_request_id_and_unknown_fields(base_url: str) -> None:
    netloc = urlsplit(base_url).netloc
    too_large = post(base_url, COMPLETIONS, b"{" + b" " * (4 * 1024 * 1024 + 1) + b"}")  # the 4 MiB default
    assert too_large.status == 413 and json.loads(too_large.read())["error"]["code"] == "request_too_large"
    conn = http.client.HTTPConnection(netloc, timeout=TIMEOUT)
    conn.request("GET", COMPLETIONS)
    wrong = conn.getresponse()
    assert wrong.status == 405 and json.loads(wrong.read())["error"]["type"] == "invalid_request_error"
    bad_id = post(base_url, COMPLETIONS, {"prompt": "x"}, {"X-Request-Id": "x" * 300})
    assert bad_id.status == 400 and "X-Request-Id" in json.loads(bad_id.read())["error"]["message"]
    # fields the API has and Tandem does not use, or that no API has, are ignored, as OpenAI does
    extra = {"prompt": "x", "max_tokens": 2, "user": "u-1", "frequency_penalty": 0, "whatever": {"a": [1]}}
    assert post(base_url, COMPLETIONS, extra).status == 200


def test_the_http_port_is_a_setting_of_its_own() -> None:
    """Default 8000, 0 = off; a port another server of the pod already takes is refused at once."""
    from pydantic import ValidationError

    from tandem.service.settings import ServerSettings

    assert ServerSettings().http_port == 8000
    assert ServerSettings(http_port=0, port=0).http_port == 0  # off beside a free gRPC port
    for clash in ({"port": 8000}, {"health_port": 8000}, {"metrics_port": 8000}):
        with pytest.raises(ValidationError, match="are both 8000: each server needs its own port"):
            ServerSettings(**clash)
    assert ServerSettings(metrics_port=8000, metrics_host="127.0.0.2").metrics_port == 8000


def test_the_http_socket_is_shared_and_sends_at_once() -> None:
    """Each front binds the port (SO_REUSEPORT), and its connections have Nagle's algorithm off: a
    stream's small events must not wait for the client's delayed ACK (40 ms each)."""
    from tandem.service.server.http_server import listening_socket

    first = listening_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = listening_socket("127.0.0.1", port)  # a second front on the same port
    try:
        first.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT):
            first.setblocking(True)
            accepted, _ = first.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                assert accepted.proto == socket.IPPROTO_TCP  # asyncio sets TCP_NODELAY itself too
    finally:
        first.close()
        second.close()


# -- cancellation -------------------------------------------------------------------------------


def _raw_request(base_url: str, stream: bool) -> socket.socket:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": stream}).encode()
    host, port = urlsplit(base_url).netloc.split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_goes_away_aborts_its_request(base_url: str, stub: pb_grpc.TandemStub, stream: bool):
    wait_idle(stub)
    sock = _raw_request(base_url, stream)
    try:
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")  # the stream has begun
        deadline = time.monotonic() + 10
        while (load := stub.GetLoad(pb.LoadRequest(), timeout=TIMEOUT)).requests_running != 1:
            assert time.monotonic() < deadline, load
            time.sleep(0.02)
        assert load.kv_blocks_free < load.kv_blocks_total
    finally:
        sock.close()  # mid-generation: 1,000 tokens take the tiny model seconds (3.7 s here)
    load = wait_idle(stub, timeout=1.0)  # aborted in the engine at its next step, its blocks freed
    assert load.kv_blocks_free == TINY_SERVER_KV_BLOCKS
    assert post(base_url, COMPLETIONS, {"prompt": "x", "max_tokens": 2}).status == 200


# -- fuzz -----------------------------------------------------------------------------------------

_SCALAR = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
_ANY = st.recursive(
    _SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
           "stream_options", "logprobs", "top_logprobs", "max_completion_tokens", "ignore_eos",
           "stop_token_ids", "return_token_ids", "echo", "logit_bias", "tools", "tool_choice",
           "parallel_tool_calls", "response_format", "prompt_logprobs", "structured_outputs", "guided_json",
           "guided_regex", "guided_choice", "guided_grammar"]  # fmt: skip
_GOOD = {"messages": [{"role": "user", "content": "hi"}], "prompt": "Once upon a time"}


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from([CHAT_PATH, COMPLETIONS]),
    fields=st.dictionaries(st.sampled_from(_FIELDS), _ANY | st.sampled_from([*_GOOD.values()]), max_size=5),
    max_tokens=st.sampled_from([1, 3, 0, -1, "3", None, 2.5]),
)
def test_fuzzed_bodies_get_a_documented_status(base_url: str, path: str, fields: dict, max_tokens) -> None:
    """Any mix of known fields with values of any JSON type: 200 or an OpenAI error of a documented
    status, never a 500 (the fields that start a generation are kept short by max_tokens)."""
    body = {**{k: v for k, v in _GOOD.items() if k not in fields}, **fields, "max_tokens": max_tokens}
    resp = post(base_url, path, json.dumps(body, allow_nan=True).encode())
    raw = resp.read()
    assert resp.status in (200, 400, 404), (resp.status, raw[:300], body)
    if resp.status != 200:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
    elif resp.getheader("content-type").startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n")
