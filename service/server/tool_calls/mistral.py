"""Mistral calls. Mistral 7B v0.3, Nemo, Small 3.0 and Mixtral write the special token `[TOOL_CALLS]`
then a JSON array of call objects; a bare array at the start of the output is read too (the token
is missing where a tokenizer does not know it as special). The v11+ tokenizers (Mistral Small 3.1
and 3.2, Magistral, Devstral, Ministral 3) write each call after its own marker as
`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, v13 with `[CALL_ID]id` before `[ARGS]`. Mistral's
templates refuse call ids that are not 9 letters or digits, so its calls get such ids."""

from .format import CallFormat, Layout, Opener

_ARRAY = Layout(open="[", sep=",", close="]")

FORMAT = CallFormat(
    "mistral",
    (Opener("[TOOL_CALLS]", _ARRAY), Opener("", _ARRAY, at_start=True)),
    special_tokens=True,
    id_chars=9,
    named_calls=True,
)
