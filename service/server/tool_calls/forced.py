"""Calls forced by a grammar (tool_choice `required` or a named function, request.forced_calls):
the output is a bare JSON array of call objects, whatever the model's family writes otherwise:

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

A request that forces calls reads this array at the start of the output besides its family's own
format (without a grammar, the model still writes its own)."""

from .format import CallFormat, Layout, Opener

OPENER = Opener("", Layout(open="[", sep=",", close="]"), at_start=True)


def reading(fmt: CallFormat) -> CallFormat:
    """`fmt` that also reads forced calls."""
    return fmt.with_openers(OPENER)
