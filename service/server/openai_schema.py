"""The OpenAI API's request bodies, as the HTTP front reads them: `/v1/chat/completions` and
`/v1/completions`, and what each field means for the engine.

Unknown fields are ignored, as OpenAI ignores them. Known fields whose values Tandem cannot honour
(n > 1, penalties, logit_bias, suffix, best_of > 1, non-text content) are refused with
a message naming the field rather than dropped in silence. Structured output
(`response_format`, and vLLM's `structured_outputs` / `guided_*`) is read by structured_fields.py
on both endpoints. `tools`, `tool_choice` and `parallel_tool_calls` are read as
tool_calls/request.py reads them (a forcing `tool_choice` constrains the output to its calls'
schema); the history's assistant calls and `tool` results go to the chat template as its
`messages`. `top_k`, `ignore_eos`, `stop_token_ids`,
`return_token_ids`, `cache_salt` and (completions only) `prompt_logprobs` are extensions, spelled
as vLLM spells them. A completion's `echo` with `logprobs` asks the engine for the prompt's logprobs
too; `max_tokens: 0` is allowed with `echo` (the prompt alone: the engine samples one token, which
the response leaves out). Values are checked
strictly (a number given as a string is an error); their ranges are resolve_params's to check, as
for gRPC.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from ..contract import StructuredOutput, invalid
from ..structured_output import canonical_schema
from . import structured_fields
from .context import Chat, Delivery
from .tool_calls.choice import ToolSupport
from .tool_calls.rendering import tools_in_messages
from .tool_calls.reply import ToolReading
from .tool_calls.request import (
    ForcedCalls,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
    check_tools,
    forced_calls,
)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's when a request names none (the native API's default is greedy)



class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a `tool` message's: the call it answers

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise invalid(
                    f"content parts of type {part.type!r} are not supported: only text",
                    f"messages.{index}.content",
                )
            texts.append(part.text)
        return "\n".join(texts)  # as vLLM joins text parts


    def for_template(self, index: int) -> dict[str, Any]:
        """As chat templates take it: OpenAI's `developer` role is a system message; calls' arguments
        are objects."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text(index)}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template(f"messages.{index}.tool_calls.{j}")
                                 for j, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise invalid("a message of role 'tool' needs the tool_call_id of the call it answers",
                              f"messages.{index}.tool_call_id")
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def chat(
    messages: list[ChatMessage], tools: list[Tool] | None = None, support: ToolSupport | None = None
) -> Chat:
    """The messages (and tools) as the chat template takes them; where the template does not render
    tools (`support`), the tools are written into the messages."""
    rendered = [m.for_template(i) for i, m in enumerate(messages)]
    if not tools:
        return Chat(rendered)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if support is not None and not support.template_renders_tools:
        return Chat(tools_in_messages(rendered, tool_dicts))
    return Chat(rendered, tool_dicts)


class _Request(_Body):
    """Fields both endpoints share. A body is what admission reads (context.WireRequest)."""

    model: str | None = None  # None: the served model (OpenAI requires it; vLLM does not)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: bool = False  # extension: generate max_tokens whatever the model says
    stop_token_ids: list[int] | None = None  # extension
    return_token_ids: bool = False  # extension: each choice carries its token ids
    cache_salt: str | None = None  # extension: shares cached prompt prefixes only within this salt
    prompt_logprobs: int | None = None  # extension (completions): the prompt's logprobs, top N each
    # structured output (docs/structured_output.md): OpenAI's, and vLLM's extensions
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def streams(self) -> bool:
        return bool(self.stream)

    def delivery(self) -> Delivery:
        return Delivery(self.streams)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_common(self) -> None:
        if self.n not in (None, 1):
            raise invalid(f"n must be 1, got {self.n}: Tandem returns one choice per request", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise invalid(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.streams:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> tuple[bool, int]:
        return False, 0

    def _prompt_logprobs(self) -> int | None:
        return None

    def structured_output(self) -> dict[str, Any]:
        """The constraint asked for, as resolve_params's keyword arguments (none: {})."""
        names = ("structured_outputs", *structured_fields.GUIDED_FIELDS)
        fields = {name: getattr(self, name) for name in names}
        asked = structured_fields.requested(self.response_format, fields)
        if asked is None:
            return {}
        return {"structured_output": asked[0], "structured_output_param": asked[1]}

    def sampling(self) -> dict[str, Any]:
        """The request's sampling fields as resolve_params's keyword arguments."""
        logprobs, top = self._logprobs()
        return self.structured_output() | {
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": self.top_p,
            "top_k": None if self.top_k == -1 else self.top_k,
            "seed": self.seed,
            "max_tokens": self._max_tokens(),
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            "stop_token_ids": list(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "top_logprobs": top,
            "prompt_logprobs": self._prompt_logprobs(),
        }


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens; it wins
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _tool_support: ToolSupport | None = PrivateAttr(None)

    def use_tools(self, support: ToolSupport) -> None:
        """How the served model takes tools: set by the front before admission."""
        self._tool_support = support

    def check(self) -> None:
        self._check_common()
        check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if self.prompt_logprobs is not None:
            raise invalid("prompt_logprobs is supported on /v1/completions only", "prompt_logprobs")

    def prompt_input(self) -> Chat:
        return chat(self.messages, self.tools, self._tool_support)

    def forced_calls(self) -> ForcedCalls | None:
        """What a forcing tool_choice (`required`, a named function) asks of the output; None otherwise.
        The output is then constrained to that schema's JSON array of calls (structured_output),
        which the response reads as the calls (tool_calls/forced.py)."""
        if not self.tools:
            return None
        return forced_calls(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_output(self) -> dict[str, Any]:
        """response_format's (or vLLM's fields') constraint, or a forcing tool_choice's: one output
        cannot follow two, so asking for both is refused."""
        asked = super().structured_output()
        forced = self.forced_calls()
        if forced is None:
            return asked
        if asked:
            raise invalid(f"a forcing tool_choice constrains the output to its calls: it cannot be combined "
                          f"with {asked['structured_output_param']}", "tool_choice")
        return {"structured_output": StructuredOutput(json_schema=canonical_schema(forced.schema)),
                "structured_output_param": "tool_choice"}

    def tool_reading(self) -> ToolReading | None:
        """How the response reads calls out of the output: None without tools or with tool_choice none
        (the tools are still shown to the model, as vLLM shows them)."""
        if not self.tools or self.tool_choice == "none" or self._tool_support is None:
            return None
        one = self.parallel_tool_calls is False or isinstance(self.tool_choice, NamedToolChoice)
        return ToolReading(self._tool_support.format, self.forced_calls(), 1 if one else None)

    def delivery(self) -> Delivery:
        reading = self.tool_reading()
        return Delivery(self.streams, special_tokens=reading is not None and reading.format.special_tokens)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the legacy API's: this many top tokens per position (0 = the chosen only)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self._check_common()
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens must be positive, got 0 (0 is allowed with echo only)", "max_tokens")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise invalid(f"best_of must be 1, got {self.best_of}", "best_of")
        if self.logprobs is not None and self.logprobs < 0:
            raise invalid(f"logprobs must be >= 0, got {self.logprobs}", "logprobs")

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids (a list of several prompts is refused, as n > 1 is)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise invalid(f"{len(p)} prompts given: Tandem takes one prompt per request", "prompt")
            return p[0]
        return p

    @property
    def prompt_text(self) -> str | None:
        """The prompt where it was given as text (what echo shows as it is), else None."""
        p = self.prompt
        if isinstance(p, str):
            return p
        return p[0] if len(p) == 1 and isinstance(p[0], str) else None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, no completion."""
        return bool(self.echo) and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens  # the engine samples at least one token

    def _logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def _prompt_logprobs(self) -> int | None:
        """The top tokens per prompt position the response shows (echo's and prompt_logprobs's)."""
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a prompt's token ids, or a chat's as its template renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # a chat's, rendered as for a chat completion
    add_special_tokens: bool = True  # a prompt's (a chat's template adds its own)
    add_generation_prompt: bool = True  # a chat's: end with the assistant's turn, as for a completion

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("give either prompt or messages", "prompt")
        check_tools(self.tools, None, None)


class DetokenizeRequest(_Body):
    """vLLM's `/detokenize`: token ids back to text."""

    model: str | None = None
    tokens: list[int]
