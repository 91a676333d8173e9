"""Mistral calls (Mistral 7B v0.3, Nemo, Small, Mixtral templates): the special token `[TOOL_CALLS]`
then a JSON array of call objects. A bare array at the start of the output is read too (the token
is missing where a tokenizer does not know it as special). Mistral's templates refuse call ids
that are not 9 letters or digits, so its calls get such ids."""

from .format import CallFormat, Layout, Opener

_ARRAY = Layout(open="[", sep=",", close="]")

FORMAT = CallFormat(
    "mistral",
    (Opener("[TOOL_CALLS]", _ARRAY), Opener("", _ARRAY, at_start=True)),
    special_tokens=True,
    id_chars=9,
)
