"""Llama 3.1/3.2/3.3 JSON calls, as their published templates ask for them: the whole answer is a
JSON object `{"name": ..., "parameters": {...}}` (several separated by `;`), possibly after the
special token `<|python_tag|>`. Output that does not start so is content."""

from .format import CallFormat, Layout, Opener

_CALLS = Layout(sep=";")

FORMAT = CallFormat(
    "llama3_json",
    (Opener("<|python_tag|>", _CALLS, at_start=True), Opener("", _CALLS, at_start=True)),
    special_tokens=True,
)
