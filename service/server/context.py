"""What a front's APIs share: the served model, its tokenizer and limits, admission and generation.

`ModelContext.generate` is the one path of a generation for every API: admit the request, tell its
trace, send it to the engine and stream its chunks (or the whole answer). Admission (`admit`) checks
in one order for every API: model name, readiness, the API's own field checks, prefix-cache scope,
prompt tokens, sampling parameters; it makes the request's
`contract.Request`, which the engine keeps. Each API only adapts its wire format to `WireRequest`
and maps RequestError onto its own errors, so another API is a thin mapping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from ..contract import ErrorKind, Limits, ModelInfo, Request, RequestError, invalid
from ..telemetry.requests import RequestTrace
from .cache_scope import cache_scope, check_salt
from .engine_client import EngineClient
from .request_stream import GenerationChunk, whole
from .tool_calls.choice import ToolSupport, tool_support
from .validation import CONTEXT_LENGTH_EXCEEDED, resolve_params, validate_prompt

INLINE_CHARS = 8192  # shorter text is tokenized on the event loop: a thread costs more than it saves


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of the vocabulary decodes to: a text of N characters has at
    least N / this many tokens."""
    return max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))


@dataclass(frozen=True)
class Chat:
    """A prompt given as messages, for the model's chat template; with the tools the template
    renders (OpenAI's tool definitions), if any."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


Prompt = str | list[int] | Chat  # text (the tokenizer adds its BOS, if any), token ids, or a chat


@dataclass(frozen=True)
class Delivery:
    """How a request is answered: in chunks as they come, or whole; and its own time bound."""

    stream: bool
    timeout_s: float | None = None  # the request's own bound (KServe's `timeout`); None: none
    special_tokens: bool = False  # its text keeps special tokens (the markers of some tool-call formats)


class WireRequest(Protocol):
    """A generation request as admission reads it, each API's fields adapted by its front.
    `ModelContext.generate` reads it in the order written here, which keeps each API's error
    precedence."""

    @property
    def model(self) -> str | None: ...  # the model asked for; empty or None: the served one

    def check(self) -> None: ...  # the API's own field checks (RequestError)

    @property
    def cache_salt(self) -> str | None: ...  # None: not given

    def prompt_input(self) -> Prompt: ...

    def sampling(self) -> dict[str, Any]: ...  # resolve_params's keyword arguments

    def delivery(self) -> Delivery: ...  # read once the request is admitted


@dataclass
class ModelContext:
    engine: EngineClient
    tokenizer: PreTrainedTokenizerBase
    limits: Limits
    model: ModelInfo  # as the engine reported it
    is_ready: Callable[[], bool] = lambda: True  # health: engine warm, tokenizer loaded, not draining
    max_token_chars: int = 1024  # the longest text one token decodes to (longest_token_chars)
    request_timeout_s: float | None = None  # the server's bound on any request (settings)
    isolate_tokens: bool = False  # a bearer token names its own prefix-cache scope (cache_scope.py)
    # the tokenizer's files clients may fetch, by name (tokenizer_files.py)
    tokenizer_files: dict[str, Path] = field(default_factory=dict)
    # how the model takes tools and writes calls (tool_calls/choice.py)
    tool_support: ToolSupport = field(default_factory=lambda: tool_support("auto", None, ""))

    @property
    def name(self) -> str:
        """The served model's name."""
        return self.model.name

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def check_model(self, requested: str) -> None:
        """An empty name means the served model; any other name must be it."""
        if requested and requested != self.name:
            raise RequestError(
                ErrorKind.NOT_FOUND,
                f"model {requested!r} is not served here; this server serves {self.name!r}",
            )

    def check_ready(self) -> None:
        if not self.is_ready():
            raise RequestError(ErrorKind.UNAVAILABLE, "the server is not ready (warming up or draining)")

    def _check_fits(self, chars: int, what: str, param: str) -> None:
        """Refuse, before tokenizing it, text too long to fit the context whatever its tokens."""
        most = self.limits.max_model_len * self.max_token_chars
        if chars > most:
            raise invalid(
                f"{what} has {chars} characters: it cannot fit the model's context length of "
                f"{self.limits.max_model_len} tokens (at most {most} characters)",
                param,
                CONTEXT_LENGTH_EXCEEDED,
            )

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Long text is tokenized in a worker thread: the event loop (health, other streams) goes on."""
        if len(text) <= INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_text(self, text: str) -> list[int]:
        if not text:
            raise invalid("prompt is empty", "prompt")
        self._check_fits(len(text), "the prompt", "prompt")
        return await self.tokenize(text)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if not self.has_chat_template:
            raise invalid(f"model {self.name!r} has no chat template", "messages")
        if not messages:
            raise invalid("chat has no messages", "messages")
        chars = sum(len(m["content"] or "") for m in messages) + len(repr(tools or ""))
        self._check_fits(chars, "the chat", "messages")
        try:
            render = self.tokenizer.apply_chat_template
            kwargs = {"add_generation_prompt": add_generation_prompt, "tokenize": True, "tools": tools}
            if chars <= INLINE_CHARS:
                out = render(messages, **kwargs)
            else:
                out = await asyncio.to_thread(render, messages, **kwargs)
        except Exception as exc:  # template errors (e.g. roles out of order) are the caller's
            raise invalid(f"chat template failed: {exc}", "messages") from exc
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def cache_scope(self, token: bytes | None, salt: str | None) -> bytes:
        """The prefix-cache scope of a request presenting `token` (verified by the auth layer, or
        None) with `cache_salt` `salt` (INVALID_ARGUMENT if it is not a valid one)."""
        return cache_scope(token if self.isolate_tokens else None, check_salt(salt))

    async def admit(self, request: WireRequest, token: bytes | None) -> Request:
        """Admit `request` or refuse it (RequestError). `token`: the caller's bearer token, as verified
        by the auth layer (None: none), which names its prefix-cache scope where tenants are isolated."""
        self.check_model(request.model or "")
        self.check_ready()
        request.check()
        scope = self.cache_scope(token, request.cache_salt)
        prompt = request.prompt_input()
        if isinstance(prompt, Chat):
            prompt_ids = await self.encode_chat(prompt.messages, tools=prompt.tools)
        elif isinstance(prompt, str):
            prompt_ids = await self.encode_text(prompt)
        else:
            prompt_ids = list(prompt)
        validate_prompt(prompt_ids, self.limits, "messages" if isinstance(prompt, Chat) else "prompt")
        params = resolve_params(self.limits, len(prompt_ids), **request.sampling())
        return self.engine.new_request(prompt_ids, params, scope)

    def _deadline(self, *bounds: float | None) -> float | None:
        """The wall clock by which a request must end: the tightest of the caller's `bounds` (seconds
        left; None: none) and the server's own; None if none is set. DEADLINE_EXCEEDED if it passed."""
        given = [t for t in (*bounds, self.request_timeout_s) if t is not None]
        if not given:
            return None
        left = min(given)
        if left <= 0:
            raise RequestError(ErrorKind.DEADLINE_EXCEEDED, "the request's deadline had passed on arrival")
        return time.time() + left

    async def generate(
        self,
        request: WireRequest,
        token: bytes | None,
        trace: RequestTrace,
        response_id: str,
        time_left: float | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Admit `request` (RequestError if refused), send it to the engine and yield its chunks as
        they come, or one chunk with everything where it is answered whole; each chunk is told to
        `trace`, which ends with the generation. `token`: the caller's verified bearer token (None:
        none); `response_id`: the id the API answers with; `time_left`: seconds the caller allows."""
        with trace:
            admitted = await self.admit(request, token)
            delivery = request.delivery()
            trace.admitted(response_id, len(admitted.prompt_ids), admitted.params, delivery.stream)
            admitted.deadline = self._deadline(time_left, delivery.timeout_s)
            chunks = self.engine.generate(admitted, self.tokenizer, delivery.special_tokens)
            if delivery.stream:
                async for chunk in chunks:
                    trace.chunk(chunk)
                    yield chunk
            else:
                answer = await whole(chunks, admitted.params.logprobs)
                trace.chunk(answer)
                yield answer


async def whole_answer(chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    """The one chunk of a generation answered whole (its delivery does not stream), run to its end so
    that its trace ends with it."""
    answer = None
    async for chunk in chunks:
        answer = chunk
    assert answer is not None, "a generation ends with a chunk or an error"
    return answer


class ContextHolder:
    """The servicers start before the model has loaded; until then calls get UNAVAILABLE."""

    def __init__(self) -> None:
        self.ctx: ModelContext | None = None

    def get(self) -> ModelContext:
        if self.ctx is None:
            raise RequestError(ErrorKind.UNAVAILABLE, "the model is still loading")
        return self.ctx
