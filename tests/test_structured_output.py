"""Structured output through a real `tandem serve` (the shared tiny test server: a random llama with the
embedded model's tokenizer, whose unconstrained output is noise, so every parse below is the
grammar's doing), asked by the published `openai` client: `chat.completions.parse` with a pydantic
model, OpenAI's response_format, vLLM's structured_outputs and guided_* fields, bad constraints
refused with 400, neighbours left as they were, a cancelled constrained stream; the native gRPC
field and KServe's sampling_parameters, with INVALID_ARGUMENT for bad ones."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import grpc
import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as tc
from pydantic import BaseModel, Field
from serverproc import TINY_SERVER_MODEL, wait_idle
from tritonclient.utils import InferenceServerException

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

TIMEOUT = 60.0


class Colour(str, Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    colour: Colour
    age: int = Field(ge=0, le=25)


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "owner": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 8},
                "address": {"type": "object", "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
                "required": ["name", "address"], "additionalProperties": False}},
        "required": ["id", "owner"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "language": {"type": "string", "enum": ["en", "fr", "de"]},
                       "urgent": {"type": "boolean"}},
        "required": ["sentiment", "language", "urgent"], "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                       "readings": {"type": "array",
                                    "items": {"type": "integer", "minimum": -5, "maximum": 5},
                                    "minItems": 2, "maxItems": 2}},
        "required": ["temperature", "humidity", "readings"], "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(tiny_openai: openai.OpenAI) -> openai.OpenAI:
    return tiny_openai


def _chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "Answer in JSON."}])
    kwargs.setdefault("max_tokens", 160)
    return client.chat.completions.create(model="", **kwargs)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="", messages=[{"role": "user", "content": "A pet, please."}], response_format=Pet,
        max_tokens=80, temperature=1.0, seed=3)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet), message.content


def test_a_hundred_seeded_outputs_of_four_schemas_all_validate(client):
    names = list(SCHEMAS)

    def one(i: int) -> tuple[int, str, str]:
        schema = SCHEMAS[names[i % len(names)]]
        r = _chat(client, temperature=1.0, seed=i, response_format={
            "type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}})
        return i, r.choices[0].finish_reason, r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    texts = set()
    for i, finish, text in results:
        assert finish == "stop", f"request {i}: {finish}: {text!r}"
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise AssertionError(f"request {i}: {text!r}") from exc
        jsonschema.validate(document, SCHEMAS[names[i % len(names)]])
        texts.add(text)
    assert len(texts) > 75, "seeded sampling gives different answers"  # (the enums allow 18 in all)


def test_json_object_mode(client):
    r = _chat(client, temperature=0.0, max_tokens=40, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")  # a random model's keys have no bound: it may run out of tokens
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{2}"}},
    {"guided_regex": r"[A-Z]{3}-[0-9]{2}"},
])
def test_regex(client, body):
    for seed in range(3):
        r = _chat(client, temperature=1.0, seed=seed, extra_body=body)
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
    {"guided_choice": ["yes", "no", "maybe so"]},
])
def test_choice_on_both_endpoints(client, body):
    chat = _chat(client, temperature=1.0, seed=1, extra_body=body)
    assert chat.choices[0].message.content in ("yes", "no", "maybe so")
    completion = client.completions.create(model="", prompt="Well?", max_tokens=10, temperature=1.0,
                                           seed=2, extra_body=body)
    assert completion.choices[0].text in ("yes", "no", "maybe so")
    assert completion.choices[0].finish_reason == "stop"


def test_grammar(client):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    body = {"structured_outputs": {"grammar": grammar}}
    r = _chat(client, temperature=1.0, seed=5, max_tokens=60, extra_body=body)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\+?[0-9]*", text), text


def test_completions_take_response_format(client):
    r = client.completions.create(model="", prompt="JSON:", max_tokens=80, temperature=1.0, seed=4,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "e", "schema": SCHEMAS["enums"]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["enums"])


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "not supported"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar",
     "not defined"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "not guided_regex, guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "not both"),
])
def test_a_bad_constraint_is_refused_with_400_naming_its_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, max_tokens=4, extra_body=body)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error


def test_a_constrained_request_leaves_its_neighbours_outputs_alone(client):
    def free(seed: int) -> str:
        r = client.completions.create(model="", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                      seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text

    alone = [free(s) for s in range(4)]
    with ThreadPoolExecutor(8) as pool:
        schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
        constrained = [pool.submit(_chat, client, temperature=1.0, seed=s, response_format=schema)
                       for s in range(4)]
        beside = list(pool.map(free, range(4)))
        for f in constrained:
            assert f.result().choices[0].finish_reason == "stop"
    assert beside == alone


def test_a_cancelled_constrained_stream_frees_its_request(client, tiny_server):
    stream = _chat(client, stream=True, max_tokens=400, temperature=1.0, seed=9,
                   response_format={"type": "json_object"})
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    assert first.choices[0].delta.content.startswith("{")
    stream.close()  # the client goes away mid-answer
    with grpc.insecure_channel(tiny_server) as channel:
        wait_idle(pb_grpc.TandemStub(channel), timeout=10.0)  # its matcher and blocks went with it


# -- the native gRPC API and KServe v2 -----------------------------------------------------------


@pytest.fixture(scope="module")
def native(tiny_server: str) -> Iterator[pb_grpc.TandemStub]:
    with grpc.insecure_channel(tiny_server) as channel:
        yield pb_grpc.TandemStub(channel)


def _generate(native, structured: pb.StructuredOutput, seed: int = 0) -> pb.GenerateResponse:
    return native.Generate(pb.GenerateRequest(
        text="Answer:", sampling=pb.SamplingParams(temperature=1.0, seed=seed),
        stopping=pb.StoppingCriteria(max_tokens=160), structured_output=structured), timeout=TIMEOUT)


def test_native_grpc_fields(native):
    r = _generate(native, pb.StructuredOutput(json_schema=json.dumps(SCHEMAS["arrays"])), seed=7)
    assert r.finish_reason == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(r.text), SCHEMAS["arrays"])
    r = _generate(native, pb.StructuredOutput(choice=pb.StructuredOutput.Choice(options=["on", "off"])))
    assert r.text in ("on", "off")
    assert re.fullmatch("[a-z]{4}", _generate(native, pb.StructuredOutput(regex="[a-z]{4}")).text)


@pytest.mark.parametrize("structured,words", [
    (pb.StructuredOutput(json_schema='{"type": "nope"}'), "Unsupported type"),
    (pb.StructuredOutput(json_schema="{"), "not valid JSON"),
    (pb.StructuredOutput(regex="[a-"), "invalid regex"),
    (pb.StructuredOutput(), "none of its fields"),
])
def test_native_grpc_refuses_a_bad_constraint_with_invalid_argument(native, structured, words):
    with pytest.raises(grpc.RpcError) as caught:
        _generate(native, structured)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()


def _kserve(tiny_server: str, sampling: dict) -> tuple[str | None, str | None]:
    """(text_output, the error's message) of a KServe ModelInfer through tritonclient."""
    client = tc.InferenceServerClient(url=tiny_server)
    try:
        inputs = []
        for name, value in (("text_input", "Answer:"), ("sampling_parameters", json.dumps(sampling))):
            tensor = tc.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
            inputs.append(tensor)
        exclude = tc.InferInput("exclude_input_in_output", [1], "BOOL")
        exclude.set_data_from_numpy(np.array([True], dtype=bool))
        inputs.append(exclude)
        result = client.infer(TINY_SERVER_MODEL, inputs, client_timeout=TIMEOUT)
        return result.as_numpy("text_output")[0].decode(), None
    except InferenceServerException as exc:
        return None, f"{exc.status()} {exc.message()}"
    finally:
        client.close()


def test_kserve_sampling_parameters(tiny_server):
    text, error = _kserve(tiny_server, {"temperature": 1.0, "seed": 3, "max_tokens": 160, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["numbers"]}}})
    assert error is None
    jsonschema.validate(json.loads(text), SCHEMAS["numbers"])
    text, _ = _kserve(tiny_server, {"max_tokens": 10, "guided_choice": ["alpha", "beta"]})
    assert text in ("alpha", "beta")
    _, error = _kserve(tiny_server, {"max_tokens": 10, "structured_outputs": {"regex": "(unclosed"}})
    assert error.startswith("StatusCode.INVALID_ARGUMENT") and "invalid regex" in error, error
