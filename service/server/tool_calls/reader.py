"""Reads tool calls out of generated text as it arrives, in one family's format (format.py).

`CallReader.feed` takes each new piece of text and returns what can be told of it already: content,
the start of a call (its name, as soon as the name is complete) and pieces of its arguments as the
model writes them; `finish` returns the rest. A whole answer is read by the same reader in one piece,
so a streamed answer and a whole one always agree.

Text that may still become a marker is held back until it is clear; text after a marker that does
not turn out to be a call is given back as content. Once a call's name is out, it stays a call: its
arguments are the text the model wrote (as OpenAI's are, they may not parse; a call cut short by
max_tokens keeps what it has). Trailing whitespace is held until text follows it, and dropped in an
answer with calls, so its content carries no newlines of the wrappers around them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import regex

from .format import FUNCTION_NAME, CallFormat, Layout


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # of the call in the answer, from 0
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the call's arguments (JSON text)


Event = Content | CallStart | CallArguments

# a call object that names its function first, up to where its arguments' value begins
_HEADER = regex.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:\s*')
# a call named outside its arguments (format.CallFormat.named_calls), up to the arguments' brace
_NAMED = regex.compile(rf"\s*({FUNCTION_NAME})(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*\{{")
_NAME_START = regex.compile(r"\s*[A-Za-z0-9_]")


class _ObjectScan:
    """One JSON object's text as it arrives: nesting depth outside strings, the offsets where its
    top-level values end (a `,` at depth 1 or the closing `}`), and whether it has closed."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.ends: list[int] = []

    @property
    def closed(self) -> bool:
        return bool(self.text) and self.depth == 0

    def feed(self, chunk: str) -> int:
        """Take `chunk` up to the object's closing brace; how many characters it took."""
        base = len(self.text)
        for i, ch in enumerate(chunk):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.ends.append(base + i)
                    self.text += chunk[: i + 1]
                    return i + 1
            elif ch == "," and self.depth == 1:
                self.ends.append(base + i)
        self.text += chunk
        return len(chunk)


def _held_suffix(text: str, markers: list[str]) -> int:
    """The length of the longest end of `text` that could be the start of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class CallReader:
    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self._anywhere = [o for o in fmt.openers if not o.at_start]
        self._at_start = [o for o in fmt.openers if o.at_start]
        self._buf = ""  # arrived, not yet read
        self._state = self._content
        self._starting = True  # nothing but whitespace read so far
        self._layout = Layout()
        self._marked = False  # the calls being read followed a marker
        self._pending = ""  # read since the last call (a marker, separators): content if no call follows
        self._held_ws = ""
        self._obj: _ObjectScan | None = None
        self._args_at: int | None = None  # where the arguments' value begins in the call's text
        self._unordered = False  # the call does not name its function first: read it whole
        self._named = False  # the call's name came before it: its object is all arguments
        self._sent = 0  # how far into the call's text its arguments are out
        self._out: list[Event] = []
        self.calls = 0  # calls begun so far

    # -- the interface ----------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._held_ws and not self.calls:
            self._out.append(Content(self._held_ws))
        self._held_ws = ""
        return self._take()

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        while self._state(final):
            pass

    # -- what is told -----------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        if not text:
            return
        text = self._held_ws + text
        body = text.rstrip()
        if body:
            self._out.append(Content(body))
        self._held_ws = text[len(body) :]

    def _eat(self, n: int) -> None:
        """Move the next `n` characters from the buffer to what a failed call gives back."""
        self._pending += self._buf[:n]
        self._buf = self._buf[n:]

    def _give_back(self) -> bool:
        """What followed a marker is no call: it is content, and reading goes on after it."""
        self._text(self._pending + (self._obj.text if self._obj else ""))
        self._pending = ""
        self._reset_call()
        self._state = self._content
        return True

    def _reset_call(self) -> None:
        self._obj, self._args_at, self._unordered, self._named, self._sent = None, None, False, False, 0

    # -- the states: each reads what it can; False when it needs more text ------------------------
    def _content(self, final: bool) -> bool:
        if self._starting:
            return self._start(final)
        found = [(self._buf.find(o.marker), o) for o in self._anywhere]
        found = [(i, o) for i, o in found if i != -1]
        if found:
            i, opener = min(found, key=lambda f: f[0])
            self._text(self._buf[:i])
            self._buf = self._buf[i:]
            self._eat(len(opener.marker))
            self._layout, self._marked, self._state = opener.layout, True, self._open
            return True
        keep = 0 if final else _held_suffix(self._buf, [o.marker for o in self._anywhere])
        self._text(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _start(self, final: bool) -> bool:
        """At the start of the output: calls that may only begin there."""
        rest = self._buf.lstrip()
        if not rest and not final:
            return False
        for opener in self._anywhere:  # a marker wins over a bare start ("[TOOL_CALLS]" over "[")
            if rest.startswith(opener.marker):
                break
            if opener.marker.startswith(rest) and not final:
                return False
        else:
            return self._bare_start(rest, final)
        self._starting = False
        return True

    def _bare_start(self, rest: str, final: bool) -> bool:
        for opener in self._at_start:
            lead = opener.marker or opener.layout.open or "{"
            if rest.startswith(lead):
                self._starting = False
                self._eat(len(self._buf) - len(rest) + len(opener.marker))
                self._layout, self._marked, self._state = opener.layout, bool(opener.marker), self._open
                return True
            if lead.startswith(rest) and not final:
                return False
        self._starting = False
        return True

    def _open(self, final: bool) -> bool:
        if self.fmt.named_calls and self._marked and _NAME_START.match(self._buf):
            self._state = self._named_call
            return True
        opening = self._layout.open
        if not opening:
            self._state = self._call
            return True
        rest = self._buf.lstrip()
        if rest.startswith(opening):
            self._eat(len(self._buf) - len(rest) + len(opening))
            self._state = self._call
            return True
        if opening.startswith(rest) and not final:
            return False
        return self._give_back()

    def _named_call(self, final: bool) -> bool:
        """`name[ARGS]{...}` after a marker: the name, then the object as the call's arguments."""
        match = _NAMED.match(self._buf, partial=True)
        if match is None or (match.partial and final):
            return self._give_back()
        if match.partial:
            return False
        self._eat(match.end() - 1)  # up to the arguments' brace
        self._begin(match.group(1))
        self._named, self._state = True, self._call
        return True

    def _call(self, final: bool) -> bool:
        if self._obj is None:
            rest = self._buf.lstrip()
            if not rest:
                return self._give_back() if final else False
            if rest[0] != "{":
                return self._give_back()
            self._eat(len(self._buf) - len(rest))
            self._obj = _ObjectScan()
            if self._named:
                self._args_at = 0
        taken = self._obj.feed(self._buf)
        self._buf = self._buf[taken:]
        if self._args_at is None and not self._unordered:
            self._find_header()
        if self._args_at is not None:
            self._send_arguments()
        if self._obj.closed:
            return self._end_call()
        if not final:
            return False
        if self._args_at is None:
            return self._give_back()
        self._next_call()  # cut short: it keeps the arguments it has
        self._state = self._content
        return True

    def _find_header(self) -> None:
        assert self._obj is not None
        text = self._obj.text
        match = _HEADER.match(text, partial=True)
        if match is None or (not match.partial and match.group(2) not in self.fmt.argument_keys):
            self._unordered = True
            return
        if match.partial or match.end() == len(text):  # the value's first character is not here yet
            return
        self._begin(json.loads(f'"{match.group(1)}"'))
        self._args_at = self._sent = match.end()

    def _send_arguments(self) -> None:
        assert self._obj is not None and self._args_at is not None
        text = self._obj.text
        # the arguments' value ends where the call object's next value begins; a named call's
        # object is its arguments, its own commas and brace included
        end = len(text) if self._named else next((e for e in self._obj.ends if e >= self._args_at), len(text))
        upto = len(text[:end].rstrip())
        if upto > self._sent:
            self._out.append(CallArguments(self.calls, text[self._sent : upto]))
            self._sent = upto

    def _begin(self, name: str) -> None:
        self._out.append(CallStart(self.calls, name))
        self._pending = ""  # the marker was a call's: nothing to give back

    def _end_call(self) -> bool:
        assert self._obj is not None
        if self._args_at is None:  # read whole: a call if it is an object with a name and arguments
            try:
                call = json.loads(self._obj.text)
            except ValueError:
                return self._give_back()
            key = next((k for k in self.fmt.argument_keys if k in call), None)
            if not isinstance(call.get("name"), str) or key is None:
                return self._give_back()
            args = call[key]
            self._begin(call["name"])
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            self._out.append(CallArguments(self.calls, text))
        self._next_call()
        self._state = self._between
        return True

    def _next_call(self) -> None:
        self.calls += 1
        self._pending = ""
        self._reset_call()

    def _between(self, final: bool) -> bool:
        """After a call: another one (the layout's separator), the layout's end, or content."""
        rest = self._buf.lstrip()
        if not rest and not final:
            return False
        sep, close = self._layout.sep, self._layout.close
        if sep and rest.startswith(sep):
            self._buf = rest
            self._eat(len(sep))
            self._state = self._call
            return True
        if close and rest.startswith(close):
            self._buf = rest[len(close) :]
            self._state = self._content
            return True
        if not final and any(t and t.startswith(rest) for t in (sep, close)):
            return False
        self._state = self._content
        return True
