"""Which format a served model writes calls in: TANDEM_TOOL_CALL_PARSER where it names one, else
what its chat template shows (the markers of each family's format), else its architecture; and
whether the template renders tools itself (rendering.py)."""

from __future__ import annotations

from dataclasses import dataclass

from . import hermes, llama3_json, mistral
from .format import CallFormat
from .rendering import renders_tools

FORMATS = {f.name: f for f in (hermes.FORMAT, llama3_json.FORMAT, mistral.FORMAT)}

# what a template that renders tools writes, first match wins: Hermes 3 is a Llama with Hermes calls
_MARKERS = (
    ("<tool_call>", hermes.FORMAT),
    ("[TOOL_CALLS]", mistral.FORMAT),
    ("<|python_tag|>", llama3_json.FORMAT),
    ("Environment: ipython", llama3_json.FORMAT),
)
_ARCHITECTURES = (("qwen", hermes.FORMAT), ("mistral", mistral.FORMAT), ("mixtral", mistral.FORMAT),
                  ("llama", llama3_json.FORMAT))


@dataclass(frozen=True)
class ToolSupport:
    format: CallFormat
    template_renders_tools: bool  # False: Tandem writes the tools into the messages, Hermes-style


def tool_support(setting: str, template: str | None, architecture: str) -> ToolSupport:
    """`setting`: TANDEM_TOOL_CALL_PARSER (auto, or a name of FORMATS)."""
    renders = renders_tools(template)
    if setting != "auto":
        return ToolSupport(FORMATS[setting], renders)
    if not renders:
        return ToolSupport(hermes.FORMAT, False)
    assert template is not None
    for marker, fmt in _MARKERS:
        if marker in template:
            return ToolSupport(fmt, True)
    arch = architecture.lower()
    for name, fmt in _ARCHITECTURES:
        if name in arch:
            return ToolSupport(fmt, True)
    return ToolSupport(hermes.FORMAT, True)
