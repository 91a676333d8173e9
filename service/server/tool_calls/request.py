"""The tools a chat request offers and how it lets the model call them, as OpenAI's API spells them
(`tools`, `tool_choice`, `parallel_tool_calls`), checked as OpenAI checks them; and, for a
choice that forces calls (`required`, or a named function), the JSON schema the output must follow
(`forced_calls`), for the grammar engine that constrains decoding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict

from ...contract import invalid
from .format import FUNCTION_NAME

_NAME = re.compile(FUNCTION_NAME)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Body):
    type: str
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: str
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the API carries it


class ToolCall(_Body):
    """A call in an assistant message of the history."""

    id: str
    type: str = "function"
    function: FunctionCall

    def for_template(self, where: str) -> dict[str, Any]:
        """As chat templates take it: the arguments as an object (templates write `arguments|tojson`)."""
        param = f"{where}.function.arguments"
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError as exc:
            raise invalid(f"{param} is not JSON: {exc}", param) from exc
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


def _check_schema(schema: dict[str, Any], where: str) -> None:
    if schema.get("type", "object") != "object":
        raise invalid(f"{where} must be a JSON schema of type 'object', got type {schema['type']!r}", where)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise invalid(f"{where} is not a valid JSON schema: {exc.message}", where) from exc


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> None:
    """Refuse (INVALID_ARGUMENT, naming the field) what OpenAI refuses: a tool that is not a function,
    a bad or repeated name, parameters that are not an object's JSON schema, a choice or
    parallel_tool_calls without tools, a named function that is not among the tools."""
    names: list[str] = []
    for i, tool in enumerate(tools or ()):
        if tool.type != "function":
            raise invalid(f"tools.{i}.type must be 'function', got {tool.type!r}", f"tools.{i}.type")
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise invalid(
                f"tools.{i}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                f"tools.{i}.function.name",
            )
        if name in names:
            raise invalid(f"tools.{i}.function.name {name!r} is given twice", f"tools.{i}.function.name")
        names.append(name)
        if tool.function.parameters is not None:
            _check_schema(tool.function.parameters, f"tools.{i}.function.parameters")
    if not names:
        if choice not in (None, "none"):
            raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
        if parallel is not None:
            raise invalid("parallel_tool_calls is only allowed when tools are given", "parallel_tool_calls")
        return
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise invalid(f"tool_choice.type must be 'function', got {choice.type!r}", "tool_choice.type")
        if choice.function.name not in names:
            raise invalid(
                f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})",
                "tool_choice.function.name",
            )


@dataclass(frozen=True)
class ForcedCalls:
    """What a forcing tool_choice asks of the output, for a grammar to constrain it: a JSON array
    of call objects `{"name": ..., "arguments": {...}}` (no wrapper of the model's own format; the
    reader reads this array as calls whatever the model's family). `names`: the functions it may
    call; `max_calls`: how many (None: any number, at least one)."""

    schema: dict[str, Any]
    names: tuple[str, ...]
    max_calls: int | None


def forced_calls(tools: list[Tool], choice: ToolChoice | None, parallel: bool | None) -> ForcedCalls | None:
    """The output schema of a choice that forces calls (`required`, or a named function); None for
    `auto`/`none`. A named function is called once; `required` calls at least one of the tools,
    exactly one when parallel_tool_calls is false. Pure: `tools` and `choice` are checked already."""
    if isinstance(choice, NamedToolChoice):
        chosen = [t.function for t in tools if t.function.name == choice.function.name]
        most: int | None = 1
    elif choice == "required":
        chosen = [t.function for t in tools]
        most = 1 if parallel is False else None
    else:
        return None
    if not chosen:  # a named function that is not among the tools: check_tools refuses it
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [f.name]}, "arguments": f.arguments_schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if most is not None:
        schema["maxItems"] = most
    return ForcedCalls(schema, tuple(f.name for f in chosen), most)


def check_forced(forced: ForcedCalls, calls: list[tuple[str, str]]) -> str | None:
    """Why `calls` ((name, arguments text) each) do not answer `forced`, or None if they do."""
    if not calls:
        return "the model's output holds no tool call"
    if forced.max_calls is not None and len(calls) > forced.max_calls:
        return f"the model called {len(calls)} tools, at most {forced.max_calls} allowed"
    for name, arguments in calls:
        if name not in forced.names:
            return f"the model called {name!r}, not one of {', '.join(forced.names)}"
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return f"the arguments of the call of {name!r} are not JSON: {arguments[:200]!r}"
        if not isinstance(parsed, dict):
            return f"the arguments of the call of {name!r} are not a JSON object: {arguments[:200]!r}"
    return None
