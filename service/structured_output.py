"""Structured output's grammars: a request's constraint (`contract.StructuredOutput`) as an xgrammar
`Grammar`, the one conversion the fronts and the engine share. The fronts build it to check a
request at admission (a bad schema, regex or grammar is refused there, with xgrammar's own message,
and never reaches the engine); the engine builds it again and compiles it against the model's
tokenizer (engine/grammar.py). Building needs no tokenizer and takes well under a millisecond for
the schemas of docs/structured_output.md.

JSON is generated compactly: no free whitespace between tokens (`{"a": 1, "b": [2, 3]}`), so a
model can neither pad its answer with blank lines until `max_tokens` nor emit invalid JSON.
"""

from __future__ import annotations

import functools
import json
import re

import xgrammar as xgr

from .contract import StructuredOutput, invalid

MAX_CONSTRAINT_CHARS = 1 << 16  # a schema, regex, grammar or all choices together, serialized
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


def canonical_schema(schema: object) -> str:
    """A JSON schema as the contract carries it: compact, its keys in the order given (the order in
    which the answer's properties come)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _size(constraint: StructuredOutput) -> int:
    parts = constraint.choice or (constraint.json_schema, constraint.regex, constraint.grammar)
    return sum(len(p) for p in parts if p is not None)


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # a JSON string literal is an EBNF string literal (the same escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar (0.2.9) writes a string with a length bound (minLength / maxLength) as characters of this
# class, which lets raw control characters through (invalid JSON: a tab, U+001E); it is swapped for
# the class of JSON's own unescaped characters
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def _json(schema: str, strict: bool = True) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if _BOUNDED_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER))


def build(constraint: StructuredOutput) -> xgr.Grammar:
    """The constraint's grammar; ValueError (with the reason) if it is not one."""
    kind = constraint.kind
    if _size(constraint) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the {kind} is longer than {MAX_CONSTRAINT_CHARS} characters")
    try:
        if kind == "json_schema":
            return _json(constraint.json_schema)
        if kind == "json_object":
            return _json('{"type": "object"}', strict=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(constraint.regex)
        if kind == "choice":
            if not constraint.choice or any(not c for c in constraint.choice):
                raise ValueError("choice needs at least one string, and no empty string")
            return xgr.Grammar.from_ebnf(_choice_ebnf(constraint.choice))
        return xgr.Grammar.from_ebnf(constraint.grammar)
    except RuntimeError as exc:  # xgrammar's C++ errors: its message, without the source location
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(_CPP_PREFIX.sub("", message)) from exc


@functools.lru_cache(maxsize=256)
def _check(constraint: StructuredOutput) -> str | None:
    try:
        build(constraint)
    except ValueError as exc:
        return str(exc)
    return None


def check(constraint: StructuredOutput, param: str) -> None:
    """Refuse (INVALID_ARGUMENT, naming the request field `param`) a constraint that is no grammar.
    Each distinct constraint is built once per front (an LRU of the last 256)."""
    try:
        kind = constraint.kind
    except ValueError as exc:
        raise invalid(str(exc), param) from exc
    why = _check(constraint)
    if why is not None:
        raise invalid(f"invalid {kind.replace('_', ' ')}: {why}", param)
