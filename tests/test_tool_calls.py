"""Tool calling on the OpenAI chat API.

The readers of each family's call format on fixed outputs (whole and streamed in every split, which
must agree), the schema a forcing tool_choice hands the grammar engine, the choice of format from
published chat templates (tests/data/chat_templates) and their rendering of tools, calls and
results; then real servers of the embedded SmolLM2-135M-Instruct, asked with the `openai` client.
Its own template does not render tools (Tandem writes them in the Hermes format); a copy served
with Llama 3.1's template renders them itself. Asked to repeat a call's text, the real model writes
it (greedy decoding: the same output every run), which the server must read as a call.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from serverproc import free_port, running_server
from transformers import AutoTokenizer

from tandem.service.contract import RequestError
from tandem.service.models.loader import default_cache_dir
from tandem.service.server.openai_schema import ChatCompletionRequest, ChatMessage, chat
from tandem.service.server.tool_calls import forced, hermes, llama3_json, mistral
from tandem.service.server.tool_calls.choice import tool_support
from tandem.service.server.tool_calls.format import CallFormat
from tandem.service.server.tool_calls.reader import CallArguments, CallReader, CallStart, Content
from tandem.service.server.tool_calls.reply import CallReply, ToolReading, new_call_id
from tandem.service.server.tool_calls.request import Tool, check_forced, forced_calls

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
MODEL = "smollm2-135m-instruct"
TIMEOUT = 120.0
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


def read(fmt: CallFormat, text: str, step: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of `text` read whole, or fed `step` characters at a time."""
    reader = CallReader(fmt)
    events = []
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    for piece in pieces:
        events += reader.feed(piece)
    events += reader.finish()
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls)
            calls.append([e.name, ""])
        elif isinstance(e, CallArguments):
            calls[e.index][1] += e.text
    return content, [tuple(c) for c in calls]


def read_every_way(fmt: CallFormat, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The text read whole; checked to read the same fed in pieces of any of several sizes."""
    whole = read(fmt, text)
    for step in (1, 2, 3, 5, 8, 13):
        assert read(fmt, text, step) == whole, step
    return whole


# -- the readers, on fixed outputs ---------------------------------------------------------------

HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", '{"city": "Paris"}')]),
    ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET, \\"}\\" <tool_call>"}}\n</tool_call>\n',
     "I will look.",
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET, \\"}\\" <tool_call>"}')]),
    # arguments before the name: read once the object is whole, written out again
    ('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call> Done.',
     " Done.", [("get_weather", '{"city": "Oslo"}')]),
    # not a call: an unknown shape, broken JSON, a marker in prose
    ('<tool_call>{"function": "f"}</tool_call>', '<tool_call>{"function": "f"}</tool_call>', []),
    ("<tool_call> not json", "<tool_call> not json", []),
    ("Use a <tool_call tag, or <tool_c", "Use a <tool_call tag, or <tool_c", []),
    ("Plain answer.\n", "Plain answer.\n", []),
    # cut short by max_tokens once the name is out: a call with what it has
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "",
     [("get_weather", '{"city": "Par')]),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "a;b"}}',
     "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "a;b"}')]),
    ("  \n{\"answer\": 42}", "  \n{\"answer\": 42}", []),  # JSON that is no call is content
    ('The call would be {"name": "get_weather", "parameters": {}}',  # a call only at the start
     'The call would be {"name": "get_weather", "parameters": {}}', []),
]

MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]',
     "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]',  # the token skipped
     "", [("get_weather", '{"city": "Paris"}')]),
    ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    # v11+ tokenizers: each call after its own marker, named outside its arguments
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}',
     "", [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    ('Looking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     "Looking.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}',  # v13: the call's id first
     "", [("get_weather", '{"city": "Oslo"}')]),
    ('[TOOL_CALLS]get_time{"tz": "CET"}', "", [("get_time", '{"tz": "CET"}')]),  # [ARGS] not special
    # no call: a name with nothing after it, words after the marker
    ("[TOOL_CALLS]get_weather[ARGS]", "[TOOL_CALLS]get_weather[ARGS]", []),
    ("[TOOL_CALLS]get the weather", "[TOOL_CALLS]get the weather", []),
    # a name no tool may have (OpenAI's rule, the request's: letters, digits, '_', '-'): not a call
    ('[TOOL_CALLS]weather.get[ARGS]{"city": "Paris"}', '[TOOL_CALLS]weather.get[ARGS]{"city": "Paris"}', []),
    # cut short by max_tokens in the arguments: a call with what it has
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "", [("get_weather", '{"city": "Par')]),
]


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [(hermes.FORMAT, *c) for c in HERMES_CASES]
    + [(llama3_json.FORMAT, *c) for c in LLAMA_CASES]
    + [(mistral.FORMAT, *c) for c in MISTRAL_CASES],
    ids=[f"hermes-{i}" for i in range(len(HERMES_CASES))] + [f"llama-{i}" for i in range(len(LLAMA_CASES))]
    + [f"mistral-{i}" for i in range(len(MISTRAL_CASES))],
)
def test_each_family_s_calls_read_whole_and_streamed(
    fmt: CallFormat, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    assert read_every_way(fmt, text) == (content, calls)


ALL_CASES = ([(hermes.FORMAT, c) for c in HERMES_CASES] + [(llama3_json.FORMAT, c) for c in LLAMA_CASES]
             + [(mistral.FORMAT, c) for c in MISTRAL_CASES])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=st.sampled_from(ALL_CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_split_of_the_text_reads_as_the_whole(case: tuple, cuts: list[int]) -> None:
    fmt, (text, content, calls) = case
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    reader = CallReader(fmt)
    events = [e for a, b in zip(points, points[1:], strict=False) for e in reader.feed(text[a:b])]
    events += reader.finish()
    got_content = "".join(e.text for e in events if isinstance(e, Content))
    names = [e.name for e in events if isinstance(e, CallStart)]
    arguments = ["".join(e.text for e in events if isinstance(e, CallArguments) and e.index == i)
                 for i in range(len(names))]
    assert (got_content, list(zip(names, arguments, strict=True))) == (content, calls)


def test_a_stream_tells_the_name_first_then_the_arguments_in_pieces() -> None:
    reader = CallReader(hermes.FORMAT)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    events = [e for i in range(len(text)) for e in reader.feed(text[i])] + reader.finish()
    assert events[0] == CallStart(0, "get_weather")
    pieces = [e.text for e in events[1:]]
    assert all(isinstance(e, CallArguments) for e in events[1:]) and len(pieces) > 5
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": 3}


def test_the_response_s_calls_ids_deltas_and_parallel_limit() -> None:
    reply = CallReply(ToolReading(mistral.FORMAT, max_calls=1))
    text = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {}}]')
    cut = text.index('"city"')
    content, deltas = reply.read(text[:cut], final=False)
    assert content == "" and deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == "get_weather"
    call_id = deltas[0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()  # Mistral's templates refuse other ids
    _, rest = reply.read(text[cut:], final=True)
    assert all(d["index"] == 0 and "id" not in d for d in rest)  # parallel_tool_calls false: one call
    assert reply.called
    message = CallReply(ToolReading(hermes.FORMAT)).whole(HERMES_CASES[1][0])
    assert message["content"] == "I will look."
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert CallReply(ToolReading(hermes.FORMAT)).whole("Hi") == {"role": "assistant", "content": "Hi"}


# -- what a forcing tool_choice asks -------------------------------------------------------------

TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]


@pytest.mark.parametrize("parallel", [None, False])
def test_required_gives_a_schema_of_calls_of_the_tools(parallel: bool | None) -> None:
    forced_ = forced_calls(TOOLS, "required", parallel)
    assert forced_ is not None and forced_.names == ("get_weather", "get_time")
    check = jsonschema.validators.validator_for(forced_.schema)(forced_.schema)
    one = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    two = one + [{"name": "get_time", "arguments": {"tz": "UTC"}}]
    assert check.is_valid(one)
    assert check.is_valid(two) == (parallel is None)
    assert not check.is_valid([])
    assert not check.is_valid([{"name": "get_weather", "arguments": {}}])  # city is required
    assert not check.is_valid([{"name": "rm_rf", "arguments": {}}])
    # the output the grammar allows is read as the calls, whatever the model's family
    text = json.dumps(two)
    for fmt in (hermes.FORMAT, llama3_json.FORMAT, mistral.FORMAT):
        content, calls = read_every_way(forced.reading(fmt), text)
        assert content == "" and [json.loads(a) for _, a in calls] == [c["arguments"] for c in two]


def test_a_named_choice_forces_one_call_of_that_function() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    body = ChatCompletionRequest.model_validate(
        {"messages": [], "tools": [WEATHER, TIME], "tool_choice": named}
    )
    forced_ = body.forced_calls()
    assert forced_ is not None and forced_.names == ("get_time",) and forced_.max_calls == 1
    assert forced_.schema["items"]["properties"]["name"] == {"type": "string", "enum": ["get_time"]}
    assert forced_.schema["maxItems"] == 1
    assert check_forced(forced_, [("get_time", '{"tz": "UTC"}')]) is None
    assert "holds no tool call" in check_forced(forced_, [])
    assert "not one of" in check_forced(forced_, [("get_weather", "{}")])
    assert "not JSON" in check_forced(forced_, [("get_time", '{"tz": ')])
    auto = ChatCompletionRequest.model_validate({"messages": [], "tools": [WEATHER]})
    assert auto.forced_calls() is None


def test_a_forced_choice_without_a_valid_call_fails_clearly() -> None:
    reply = CallReply(ToolReading(hermes.FORMAT, forced_calls(TOOLS, "required", None)))
    with pytest.raises(RequestError) as exc:
        reply.whole("I cannot call tools.")
    assert exc.value.code == "tool_call_not_parsed" and "holds no tool call" in exc.value.message


# -- templates: which format, and what they render ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smol_dir: Path):
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.mark.parametrize(
    ("template", "architecture", "expected", "renders"),
    [
        ("llama-3.1-instruct.jinja", "LlamaForCausalLM", "llama3_json", True),
        ("qwen2.5-instruct.jinja", "Qwen2ForCausalLM", "hermes", True),
        ("mistral-nemo-instruct-2407.jinja", "MistralForCausalLM", "mistral", True),
        (None, "LlamaForCausalLM", "hermes", False),  # SmolLM2's: no tools in it
    ],
)
def test_the_format_follows_the_template(
    tokenizer, template: str | None, architecture: str, expected: str, renders: bool
) -> None:
    source = (TEMPLATES / template).read_text() if template else tokenizer.chat_template
    support = tool_support("auto", source, architecture)
    assert (support.format.name, support.template_renders_tools) == (expected, renders)
    assert tool_support("mistral", source, architecture).format.name == "mistral"  # the setting wins


def _history(call_id: str) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"celsius": 21}'},
    ]


@pytest.mark.parametrize("template", [*sorted(p.name for p in TEMPLATES.glob("*.jinja")), None])
def test_templates_render_the_tools_calls_and_results(tokenizer, template: str | None) -> None:
    source = (TEMPLATES / template).read_text() if template else tokenizer.chat_template
    support = tool_support("auto", source, "")
    messages = [ChatMessage.model_validate(m) for m in _history(new_call_id(support.format.id_chars))]
    prompt = chat(messages, [Tool.model_validate(WEATHER)], support)
    text = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools, chat_template=source,
                                         tokenize=False, add_generation_prompt=True)
    assert "Get the current weather in a city" in text  # the tool
    assert '"city": "Paris"' in text  # the call
    assert "celsius" in text and "21" in text  # its result (Llama 3.1's writes it as a JSON string)
    if template is None:
        assert "<tool_call>" in text and "<tool_response>" in text


def test_history_and_tool_checks_refuse_with_the_field(tokenizer) -> None:
    bad_args = _history("abc")
    bad_args[1]["tool_calls"][0]["function"]["arguments"] = "{city"
    with pytest.raises(RequestError) as exc:
        chat([ChatMessage.model_validate(m) for m in bad_args])
    assert exc.value.param == "messages.1.tool_calls.0.function.arguments"
    no_id = _history("abc")
    del no_id[2]["tool_call_id"]
    with pytest.raises(RequestError) as exc:
        chat([ChatMessage.model_validate(m) for m in no_id])
    assert exc.value.param == "messages.2.tool_call_id"


# -- real servers ---------------------------------------------------------------------------------

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPEAT = [{"role": "user", "content": f"Repeat this text exactly, and nothing else:\n{CALL_TEXT}"}]


@pytest.fixture(scope="module")
def cache_dir() -> str:
    return str(Path(os.environ.get("TANDEM_TEST_CACHE", default_cache_dir())))


@pytest.fixture(scope="module")
def client(serve, cache_dir: str) -> Iterator[openai.OpenAI]:
    """The embedded model, whose template does not render tools."""
    live = serve("--cache-dir", cache_dir, model=None, http=True)
    with openai.OpenAI(base_url=f"{live.http_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


def test_a_call_the_model_writes_is_a_tool_call_and_its_result_goes_back(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=REPEAT, tools=[WEATHER], temperature=0,
                                           max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the round trip: the call and its result in the history, the model answers in text
    history = [*REPEAT, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=40)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # tool_choice none: the same output is text
    text = client.chat.completions.create(model=MODEL, messages=REPEAT, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=40)
    assert text.choices[0].message.tool_calls is None and "<tool_call>" in text.choices[0].message.content
    # a forced choice is a call of that function, by grammar, even where the model would chat;
    # one cut short by max_tokens fails clearly
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced_ = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                             tools=[WEATHER, TIME], tool_choice=named, temperature=0,
                                             max_tokens=60)
    assert forced_.choices[0].finish_reason == "tool_calls"
    (call,) = forced_.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                       tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=3)
    assert exc.value.body["code"] == "tool_call_not_parsed"


BOUNDED = {  # a tool whose every argument is bounded: a sampled call always ends within max_tokens
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "label": {"type": "string", "maxLength": 12},
                           "days": {"type": "array", "items": {"enum": ["mon", "sat"]}, "maxItems": 2}},
            "required": ["hour", "label", "days"],
            "additionalProperties": False,
        },
    },
}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}],
                         ids=["required", "named"])
def test_forced_calls_are_valid_calls_every_time(client: openai.OpenAI, choice) -> None:
    """Sampled at temperature 1 over several seeds, a forced choice is always a call of an offered
    function whose arguments validate against its parameters (and the named one when named). One call
    each (parallel_tool_calls false): a parallel array's length is the model's to choose, so a random
    walk may run it to max_tokens."""
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (BOUNDED, ZONE)}

    def ask(seed: int):  # noqa: ANN202
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Wake me up early on weekends."}],
            tools=[BOUNDED, ZONE], tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=seed,
            max_tokens=80)

    with ThreadPoolExecutor(10) as pool:  # in flight together: the engine batches them
        replies = list(pool.map(ask, range(10)))
    for seed, reply in enumerate(replies):
        assert reply.choices[0].finish_reason == "tool_calls", (seed, reply.choices[0])
        (call,) = reply.choices[0].message.tool_calls
        assert choice == "required" or call.function.name == "set_alarm"
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_streamed_calls_are_deltas_the_sdk_accumulates(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=REPEAT, tools=[WEATHER], temperature=0,
                                           max_tokens=40)
    chunks = list(client.chat.completions.create(model=MODEL, messages=REPEAT, tools=[WEATHER], temperature=0,
                                                 max_tokens=40, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert len(deltas) > 2 and all(d.index == 0 and d.id is None for d in deltas[1:])  # arguments in pieces
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    with client.chat.completions.stream(model=MODEL, messages=REPEAT, tools=[WEATHER], temperature=0,
                                        max_tokens=40) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    expected = whole.choices[0].message.tool_calls[0].function
    assert (call.function.name, call.function.arguments) == (expected.name, expected.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    # a forced choice streams its call as deltas; one cut short by max_tokens ends with the error
    forced_chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=60, stream=True))
    forced_deltas = [d for c in forced_chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert forced_deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in forced_deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert forced_chunks[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.APIError) as exc:
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                            tools=[WEATHER], tool_choice="required", temperature=0,
                                            max_tokens=3, stream=True))
    assert exc.value.body["code"] == "tool_call_not_parsed", exc.value.body


class Pet(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(client: openai.OpenAI, method: str) -> None:
    """LangChain's ChatOpenAI, unmodified, on the embedded model: json_schema sends response_format's
    schema, function_calling a tool with a named tool_choice (a forced call: its arguments constrained
    to the schema), json_mode response_format json_object (LangChain parses the object, validating
    nothing: the model is asked for the keys)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="unused", temperature=0,
                     max_tokens=60, max_retries=0, timeout=TIMEOUT)
    question = "Invent a pet. Reply with JSON with the keys name and age."
    if method == "json_mode":
        out = llm.with_structured_output({"title": "Pet", "type": "object"}, method=method).invoke(question)
        assert isinstance(out, dict) and out, out
    else:
        out = llm.with_structured_output(Pet, method=method).invoke(question)
        assert isinstance(out, Pet), out


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools.0.function"),
        ({"tools": [{"type": "web", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools.0.function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ],
)
def test_bad_tools_are_400_naming_the_field(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=fields
        )
    assert exc.value.body["param"] == param, exc.value.body
    assert exc.value.body["type"] == "invalid_request_error" and exc.value.body["message"]


@pytest.fixture(scope="module")
def llama_template_server(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory, cache_dir: str):
    """The embedded model's weights served under Llama 3.1's chat template, which renders tools."""
    model = tmp_path_factory.mktemp("llama-template")
    for file in smol_dir.iterdir():  # the weights linked, the small files copied
        (model / file.name).symlink_to(file) if file.suffix == ".safetensors" else shutil.copy(file, model)
    (model / "chat_template.jinja").write_text((TEMPLATES / "llama-3.1-instruct.jinja").read_text())
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    port = free_port()
    log = tmp_path_factory.mktemp("llama-template-log") / "server.log"
    with running_server(model, "--http-port", str(port), "--model-name", "llama-template", log=log):
        yield f"http://127.0.0.1:{port}", AutoTokenizer.from_pretrained(model)


def test_a_template_that_renders_tools_gets_them_in_the_engine_s_prompt(llama_template_server) -> None:
    url, tok = llama_template_server
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"}
    history = [*REPEAT, {"role": "assistant", "tool_calls": [call]}, result]
    as_template_takes_it = [*REPEAT, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, result]
    expected = tok.apply_chat_template(as_template_takes_it, tools=[WEATHER], add_generation_prompt=True,
                                       tokenize=False)
    assert "Environment: ipython" in expected and '"parameters": {"city": "Oslo"}' in expected
    expected_ids = tok.encode(expected, add_special_tokens=False)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        answer = c.chat.completions.create(model="llama-template", messages=history, tools=[WEATHER],
                                           temperature=0, max_tokens=4)
    assert answer.usage.prompt_tokens == len(expected_ids)
    body = json.dumps({"messages": history, "tools": [WEATHER]}).encode()
    request = urllib.request.Request(f"{url}/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as resp:
        assert json.loads(resp.read())["tokens"] == expected_ids
