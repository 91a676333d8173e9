"""What a front's servicers share: the served model, its tokenizer and limits, and admission.

`ModelContext` is the one place a request is admitted: readiness, model name, prompt encoding and
checks, the engine's own request id; the servicers only map their API's fields onto it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from ..engine.errors import ErrorKind, RequestError, invalid
from ..engine.sampling_params import SamplingParams
from ..engine.validation import Limits, validate_prompt
from ..ipc.messages import ModelInfo
from .cache_scope import cache_scope, check_salt
from .engine_client import EngineClient
from .request_stream import GenerationChunk

INLINE_CHARS = 8192  # shorter text is tokenized on the event loop: a thread costs more than it saves


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of the vocabulary decodes to: a text of N characters has at
    least N / this many tokens."""
    return max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))


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

    def _deadline(self, time_left: float | None) -> float | None:
        """The request's deadline (wall clock): the caller's time left or the server's bound."""
        bounds = [t for t in (time_left, self.request_timeout_s) if t is not None]
        if not bounds:
            return None
        left = min(bounds)
        if left <= 0:
            raise RequestError(ErrorKind.DEADLINE_EXCEEDED, "the request's deadline had passed on arrival")
        return time.time() + left

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        time_left: float | None = None,
        scope: bytes = b"",
    ) -> AsyncIterator[GenerationChunk]:
        """Admit a request (RequestError if it is not) and stream its chunks. `time_left`: seconds
        the caller allows (None = no deadline of its own); `scope`: its prefix-cache scope."""
        validate_prompt(prompt_ids, self.limits)
        deadline = self._deadline(time_left)
        return self.engine.generate(prompt_ids, params, self.tokenizer, deadline, scope)

    async def generate_all(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        time_left: float | None = None,
        scope: bytes = b"",
    ) -> GenerationChunk:
        validate_prompt(prompt_ids, self.limits)
        deadline = self._deadline(time_left)
        return await self.engine.generate_all(prompt_ids, params, self.tokenizer, deadline, scope)


class ContextHolder:
    """The servicers start before the model has loaded; until then calls get UNAVAILABLE."""

    def __init__(self) -> None:
        self.ctx: ModelContext | None = None

    def get(self) -> ModelContext:
        if self.ctx is None:
            raise RequestError(ErrorKind.UNAVAILABLE, "the model is still loading")
        return self.ctx
