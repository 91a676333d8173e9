"""What a front's servicers share: the served model, its tokenizer and limits, and admission.

`ModelContext.admit` is the one place a request is admitted, in one order for every API: readiness,
model name (KServe checks it itself, first), the API's own field checks, prefix-cache scope, prompt
tokens, sampling parameters. Each front only adapts its wire format to `WireRequest` and maps
RequestError onto its own errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from ..engine.errors import ErrorKind, RequestError, invalid
from ..engine.sampling_params import SamplingParams
from ..engine.validation import Limits, resolve_params, validate_prompt
from ..ipc.messages import ModelInfo
from .cache_scope import cache_scope, check_salt
from .engine_client import EngineClient
from .request_stream import GenerationChunk

INLINE_CHARS = 8192  # shorter text is tokenized on the event loop: a thread costs more than it saves


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of the vocabulary decodes to: a text of N characters has at
    least N / this many tokens."""
    return max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))


@dataclass(frozen=True)
class Chat:
    """A prompt given as messages, for the model's chat template."""

    messages: list[dict[str, str]]


Prompt = str | list[int] | Chat  # text (the tokenizer adds its BOS, if any), token ids, or a chat


class WireRequest(Protocol):
    """A generation request as admission reads it, each API's fields adapted by its front.
    `ModelContext.admit` reads it in the order written here, which keeps each API's error precedence."""

    @property
    def model(self) -> str | None: ...  # the model asked for; empty or None: the served one

    def check(self) -> None: ...  # the API's own field checks (RequestError)

    @property
    def cache_salt(self) -> str | None: ...  # None: not given

    def prompt_input(self) -> Prompt: ...

    def sampling(self) -> dict[str, Any]: ...  # resolve_params's keyword arguments


@dataclass(frozen=True)
class Admitted:
    """An admitted request: what the engine is sent (ModelContext.generate)."""

    prompt_ids: list[int]
    params: SamplingParams
    scope: bytes  # its prefix-cache scope (cache_scope.py)


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

    def _check_fits(self, chars: int, what: str) -> None:
        """Refuse, before tokenizing it, text too long to fit the context whatever its tokens."""
        most = self.limits.max_model_len * self.max_token_chars
        if chars > most:
            raise invalid(
                f"{what} has {chars} characters: it cannot fit the context length of "
                f"{self.limits.max_model_len} tokens (at most {most} characters)"
            )

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Long text is tokenized in a worker thread: the event loop (health, other streams) goes on."""
        if len(text) <= INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_text(self, text: str) -> list[int]:
        if not text:
            raise invalid("prompt is empty")
        self._check_fits(len(text), "the prompt")
        return await self.tokenize(text)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"model {self.name!r} has no chat template")
        if not messages:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "chat has no messages")
        chars = sum(len(m["content"]) for m in messages)
        self._check_fits(chars, "the chat")
        try:
            render = self.tokenizer.apply_chat_template
            kwargs = {"add_generation_prompt": True, "tokenize": True}
            if chars <= INLINE_CHARS:
                out = render(messages, **kwargs)
            else:
                out = await asyncio.to_thread(render, messages, **kwargs)
        except Exception as exc:  # template errors (e.g. roles out of order) are the caller's
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"chat template failed: {exc}") from exc
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def cache_scope(self, token: bytes | None, salt: str | None) -> bytes:
        """The prefix-cache scope of a request presenting `token` (verified by the auth layer, or
        None) with `cache_salt` `salt` (INVALID_ARGUMENT if it is not a valid one)."""
        return cache_scope(token if self.isolate_tokens else None, check_salt(salt))

    async def admit(self, request: WireRequest, token: bytes | None) -> Admitted:
        """Admit `request` or refuse it (RequestError). `token`: the caller's bearer token, as verified
        by the auth layer (None: none), which names its prefix-cache scope where tenants are isolated."""
        self.check_ready()
        self.check_model(request.model or "")
        request.check()
        scope = self.cache_scope(token, request.cache_salt)
        prompt = request.prompt_input()
        if isinstance(prompt, Chat):
            prompt_ids = await self.encode_chat(prompt.messages)
        elif isinstance(prompt, str):
            prompt_ids = await self.encode_text(prompt)
        else:
            prompt_ids = list(prompt)
        return Admitted(prompt_ids, resolve_params(self.limits, len(prompt_ids), **request.sampling()), scope)

    def _last_checks(self, request: Admitted, time_left: float | None) -> float | None:
        """What generate and generate_all check before the engine: the prompt's tokens, then the time
        left (RequestError if either fails). Returns the deadline (wall clock): the caller's time left
        or the server's bound, whichever ends first; None if neither is set."""
        validate_prompt(request.prompt_ids, self.limits)
        bounds = [t for t in (time_left, self.request_timeout_s) if t is not None]
        if not bounds:
            return None
        left = min(bounds)
        if left <= 0:
            raise RequestError(ErrorKind.DEADLINE_EXCEEDED, "the request's deadline had passed on arrival")
        return time.time() + left

    def generate(self, request: Admitted, time_left: float | None = None) -> AsyncIterator[GenerationChunk]:
        """Send an admitted request to the engine (RequestError if its last checks fail) and stream its
        chunks. `time_left`: seconds the caller allows (None = no deadline of its own)."""
        deadline = self._last_checks(request, time_left)
        return self.engine.generate(
            request.prompt_ids, request.params, self.tokenizer, deadline, request.scope
        )

    async def generate_all(self, request: Admitted, time_left: float | None = None) -> GenerationChunk:
        """As generate, run to completion: one chunk with everything."""
        deadline = self._last_checks(request, time_left)
        return await self.engine.generate_all(
            request.prompt_ids, request.params, self.tokenizer, deadline, request.scope
        )


class ContextHolder:
    """The servicers start before the model has loaded; until then calls get UNAVAILABLE."""

    def __init__(self) -> None:
        self.ctx: ModelContext | None = None

    def get(self) -> ModelContext:
        if self.ctx is None:
            raise RequestError(ErrorKind.UNAVAILABLE, "the model is still loading")
        return self.ctx
