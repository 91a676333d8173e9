"""The request fields that ask for structured output, as the APIs spell them, read into the contract's
one record (`contract.StructuredOutput`): OpenAI's `response_format`, vLLM's `structured_outputs`
and its older `guided_*` fields. The HTTP front reads them from the body; the KServe front from a
request's `sampling_parameters` JSON, with the same names. Every mistake is an INVALID_ARGUMENT
naming its field; the constraint itself is checked by admission (structured_output.check).
"""

from __future__ import annotations

import json
from typing import Any

from ..contract import StructuredOutput, invalid
from ..structured_output import canonical_schema

# vLLM's StructuredOutputsParams options that only tune whitespace or fallbacks: Tandem's JSON is
# always compact and there is no fallback engine, so they change nothing and are accepted
_IGNORED_OPTIONS = frozenset({"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                              "whitespace_pattern"})
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _schema(value: object, param: str) -> str:
    """A JSON schema given as an object (or a boolean schema), or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(f"the JSON schema is not valid JSON: {exc}", param) from exc
    if not isinstance(value, (dict, bool)):
        raise invalid(f"a JSON schema is an object, got {type(value).__name__}", param)
    return canonical_schema(value)


def schema_text(text: str, param: str) -> str:
    """A JSON schema given as JSON text (the native API's field), as the contract carries it."""
    return _schema(text, param)


def _strings(value: object, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise invalid("choice must be a non-empty list of strings", param)
    return tuple(value)


def _text(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid("must be a non-empty string", param)
    return value


def response_format(value: dict[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} (`strict` or not, the schema is enforced)."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise invalid("response_format json_schema needs a json_schema object", param)
        if "schema" not in spec:
            raise invalid("response_format.json_schema.schema is required", f"{param}.schema")
        return StructuredOutput(json_schema=_schema(spec["schema"], f"{param}.schema"))
    raise invalid(f"response_format type {kind!r} is not supported: text, json_object or json_schema",
                  "response_format.type")


def vllm_fields(fields: dict[str, Any]) -> tuple[StructuredOutput, str] | None:
    """vLLM's `structured_outputs` {json | regex | choice | grammar | json_object} or one of its older
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields, from a mapping of
    the request's fields (None values = not given). -> (the constraint, the field it came from)."""
    given = [(name, fields[name]) for name in ("structured_outputs", *GUIDED_FIELDS)
             if fields.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise invalid(f"give one of structured_outputs and guided_*, not {names}", given[1][0])
    name, value = given[0]
    if name == "guided_json":
        return StructuredOutput(json_schema=_schema(value, name)), name
    if name == "guided_regex":
        return StructuredOutput(regex=_text(value, name)), name
    if name == "guided_choice":
        return StructuredOutput(choice=_strings(value, name)), name
    if name == "guided_grammar":
        return StructuredOutput(grammar=_text(value, name)), name
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", name)
    keys = {k for k, v in value.items() if v is not None and v is not False} - _IGNORED_OPTIONS
    unknown = keys - {"json", "regex", "choice", "grammar", "json_object"}
    if unknown:
        raise invalid(f"structured_outputs.{sorted(unknown)[0]} is not supported: json, regex, choice, "
                      "grammar or json_object", name)
    if len(keys) != 1:
        raise invalid("structured_outputs needs exactly one of json, regex, choice, grammar or json_object",
                      name)
    (key,) = keys
    param = f"{name}.{key}"
    if key == "json":
        return StructuredOutput(json_schema=_schema(value[key], param)), param
    if key == "regex":
        return StructuredOutput(regex=_text(value[key], param)), param
    if key == "choice":
        return StructuredOutput(choice=_strings(value[key], param)), param
    if key == "grammar":
        return StructuredOutput(grammar=_text(value[key], param)), param
    return StructuredOutput(json_object=True), param


def requested(response_format_value: dict[str, Any] | None,
              fields: dict[str, Any]) -> tuple[StructuredOutput, str] | None:
    """The one constraint a request asks for, by `response_format` or vLLM's fields (not both)."""
    from_format = response_format(response_format_value)
    from_vllm = vllm_fields(fields)
    if from_format is not None and from_vllm is not None:
        raise invalid(f"give response_format or {from_vllm[1].split('.')[0]}, not both", from_vllm[1])
    if from_format is None:
        return from_vllm
    param = "response_format.json_schema.schema" if from_format.json_schema is not None else "response_format"
    return from_format, param
