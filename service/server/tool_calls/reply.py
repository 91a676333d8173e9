"""One chat response's tool calls as the OpenAI API shows them: `message.tool_calls` of a whole
answer, or the `delta.tool_calls` of a stream's chunks (the first delta of a call carries its
index, id, type and name, with arguments ""; the next ones pieces of its arguments), each call
with an id of its own. A request that forces calls (request.ForcedCalls) fails with INTERNAL
(HTTP 500) when the model's output holds no valid call: nothing constrained it yet, or it ran
out of tokens."""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...contract import ErrorKind, RequestError
from . import forced as forced_format
from .format import CallFormat
from .reader import CallArguments, CallReader, CallStart, Content, Event
from .request import ForcedCalls, check_forced

_ALNUM = string.ascii_letters + string.digits


def new_call_id(chars: int | None) -> str:
    if chars is not None:  # Mistral's templates refuse any other id
        return "".join(secrets.choice(_ALNUM) for _ in range(chars))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolReading:
    """How a response reads calls: the model's format, what a forcing choice asks (None: `auto`), and
    how many calls it may show (parallel_tool_calls false: one; later calls are left out)."""

    format: CallFormat
    forced: ForcedCalls | None = None
    max_calls: int | None = None


@dataclass
class CallReply:
    reading: ToolReading
    _reader: CallReader = field(init=False)
    _calls: list[list[str]] = field(default_factory=list, init=False)  # [id, name, arguments] each

    def __post_init__(self) -> None:
        fmt = self.reading.format
        self._reader = CallReader(forced_format.reading(fmt) if self.reading.forced else fmt)

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def _shown(self, index: int) -> bool:
        most = self.reading.max_calls
        return most is None or index < most

    def read(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and tool-call deltas that `text`, the next text of the answer, makes known
        (`final`: it is the last)."""
        events: list[Event] = self._reader.feed(text)
        if final:
            events += self._reader.finish()
        content, deltas = "", []
        for event in events:
            if isinstance(event, Content):
                content += event.text
            elif not self._shown(event.index):
                continue
            elif isinstance(event, CallStart):
                call_id = new_call_id(self.reading.format.id_chars)
                self._calls.append([call_id, event.name, ""])
                deltas.append({"index": event.index, "id": call_id, "type": "function",
                               "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, CallArguments):
                self._calls[event.index][2] += event.text
                if deltas and deltas[-1]["index"] == event.index:
                    deltas[-1]["function"]["arguments"] += event.text
                else:
                    deltas.append({"index": event.index, "function": {"arguments": event.text}})
        if final:
            self._check()
        return content, deltas

    def whole(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole answer."""
        content, _ = self.read(text, final=True)
        if not self._calls:
            return {"role": "assistant", "content": content}
        calls = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in self._calls
        ]
        return {"role": "assistant", "content": content or None, "tool_calls": calls}

    def _check(self) -> None:
        forced = self.reading.forced
        if forced is None:
            return
        why = check_forced(forced, [(name, arguments) for _, name, arguments in self._calls])
        if why is not None:
            raise RequestError(
                ErrorKind.INTERNAL,
                f"tool_choice asks for a call of {', '.join(forced.names)}, but {why}",
                code="tool_call_not_parsed",
            )
