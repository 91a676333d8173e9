"""How the prompt shows the tools. A chat template that knows tools (it reads `tools`) renders them
itself, with the calls and results of the history, in its model's own format. For one that does
not, Tandem writes them into the messages in the Hermes format (a system message listing the tools
and asking for `<tool_call>` tags, calls and results as text), which the hermes reader then reads.
"""

from __future__ import annotations

import json
from typing import Any

_CALL = '{"name": <function-name>, "arguments": <args-json-object>}'


def renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def _tools_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to help with the user's request. "
        f"Their signatures are within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments within "
        f"<tool_call></tool_call> tags:\n<tool_call>\n{_CALL}\n</tool_call>"
    )


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def tools_in_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with `tools` written into them for a template that knows only roles and text: the
    tools in the system message (a new one first if there is none), an assistant's calls as
    `<tool_call>` text after its content, each run of tool results as one user message of
    `<tool_response>` parts."""
    out: list[dict[str, Any]] = []
    prompt = _tools_prompt(tools)
    if messages and messages[0]["role"] == "system":
        out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": prompt})
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        elif m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            parts += [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]
