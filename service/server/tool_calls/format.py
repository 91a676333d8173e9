"""What a family's tool-call text looks like, as the reader needs it: where calls begin (a marker,
anywhere in the text or only at its start), how several calls are laid out after it, and the keys of
a call's JSON object. Every family writes a call as a JSON object `{"name": ..., "arguments": ...}`
(or `"parameters"`); they differ in what surrounds it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# a function's name, by OpenAI's rule: what a request's tools may be named, and so what the reader
# takes as the name of a call written outside its arguments
FUNCTION_NAME = r"[A-Za-z0-9_-]{1,64}"


@dataclass(frozen=True)
class Layout:
    """The text around the calls that follow one marker."""

    open: str = ""  # before the first call ("[" for a JSON array)
    sep: str | None = None  # between two calls (None: one call per marker)
    close: str = ""  # after the last call ("" : nothing)


@dataclass(frozen=True)
class Opener:
    """Where calls begin: `marker` then calls laid out as `layout`. An empty marker means the first
    call (or `layout.open`) starts right away; `at_start`: only at the start of the output."""

    marker: str
    layout: Layout
    at_start: bool = False


@dataclass(frozen=True)
class CallFormat:
    name: str  # as TANDEM_TOOL_CALL_PARSER names it
    openers: tuple[Opener, ...]
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    special_tokens: bool = False  # its markers are special tokens: the text must keep them
    id_chars: int | None = None  # the model's templates want call ids of exactly this many letters/digits
    # after a marker, a call may also be written `name[ARGS]{arguments}` (Mistral's v11+ tokenizers;
    # `[CALL_ID]id` may come between them): the name outside the JSON, the object all arguments
    named_calls: bool = False

    def with_openers(self, *more: Opener) -> CallFormat:
        return dataclasses.replace(self, openers=(*self.openers, *more))
