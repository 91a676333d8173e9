"""OpenAI response bodies made from the engine's chunks: chat completions and completions, whole
and as stream chunks, with usage and logprobs; and OpenAI's error body.

A chat response whose request offers tools reads the model's calls out of its text
(tool_calls/reply.py): `message.tool_calls` or `delta.tool_calls`, the text outside the calls as
content, and finish_reason `tool_calls` where the model stopped after calling.

A token in logprobs is named by its own text (the token decoded alone), as OpenAI names it, not by
its vocabulary entry as the native API does. `stop_reason` (the stop string or stop token id that
ended a request) and `token_ids` (when the request sets `return_token_ids`) are vLLM's extensions.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from transformers import PreTrainedTokenizerBase

from ..contract import ErrorKind, FinishReason, RequestError, TokenLogprob
from .request_stream import GenerationChunk
from .tool_calls.reply import CallReply

FINISH = {
    None: None,
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",  # vLLM's word; a client still listening does not get it
}

# ErrorKind -> (HTTP status, OpenAI error type, OpenAI error code)
STATUS = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
    ErrorKind.INTERNAL: (500, "server_error", "internal_error"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param(err: RequestError) -> str | None:
    """The request field an error is about (OpenAI's `param`): the one admission named, or the
    model's for NOT_FOUND."""
    if err.param is None and err.kind is ErrorKind.NOT_FOUND:
        return "model"
    return err.param


def request_error(err: RequestError) -> tuple[int, dict]:
    """A request error as (HTTP status, OpenAI error body)."""
    status, type_, code = STATUS[err.kind]
    return status, error_body(err.message, type_, _param(err), err.code or code)


def usage(chunk: GenerationChunk) -> dict:
    p, c = chunk.prompt_tokens, chunk.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": chunk.cached_tokens}}


class TokenTexts:
    """Each token's own text, cached: the logprobs of a stream name the same tokens over and over."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id])
        )


@dataclass
class _Response:
    """One request's response, as its chunks go out (a stream's renderer keeps its running state)."""

    id: str
    model: str
    texts: TokenTexts | None = None  # set when the request asked for logprobs
    token_ids: bool = False  # the request's return_token_ids
    created: int = field(default_factory=lambda: int(time.time()))
    _first: bool = field(default=True, init=False)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, chunk: GenerationChunk, body: dict) -> dict:
        choice = {
            "index": 0,
            **body,
            "logprobs": self._logprobs(chunk),
            "finish_reason": FINISH[chunk.finish_reason],
        }
        if chunk.finish_reason is not None:  # null where the model ended it (EOS), as vLLM's
            choice["stop_reason"] = chunk.stop_reason
        if self.token_ids:
            choice["token_ids"] = chunk.token_ids
        return choice

    # the response's "object" whole and as a stream's chunk, and each kind's body of a choice
    whole_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def _whole_body(self, done: GenerationChunk) -> dict:
        raise NotImplementedError

    def _chunk_body(self, chunk: GenerationChunk) -> dict:
        raise NotImplementedError

    def _logprobs(self, chunk: GenerationChunk) -> dict | None:
        raise NotImplementedError

    def whole(self, done: GenerationChunk) -> dict:
        return {
            **self._head(self.whole_object),
            "choices": [self._choice(done, self._whole_body(done))],
            "usage": usage(done),
        }

    def stream_chunk(self, chunk: GenerationChunk, with_usage: bool = False) -> dict:
        out = {**self._head(self.chunk_object), "choices": [self._choice(chunk, self._chunk_body(chunk))]}
        if with_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last, which carries it
        return out

    def usage_chunk(self, last: GenerationChunk) -> dict:
        """The stream's last chunk under stream_options.include_usage: no choices, the usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(last)}

    def _entries(self, chunk: GenerationChunk) -> list[tuple[int, TokenLogprob]]:
        return list(zip(chunk.token_ids, chunk.logprobs or [], strict=False))


@dataclass
class ChatResponse(_Response):
    calls: CallReply | None = None  # where the request offers tools: its calls, read from the text

    whole_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _choice(self, chunk: GenerationChunk, body: dict) -> dict:
        choice = super()._choice(chunk, body)
        if self.calls is not None and self.calls.called and chunk.finish_reason is FinishReason.STOP:
            choice["finish_reason"] = "tool_calls"
        return choice

    def _whole_body(self, done: GenerationChunk) -> dict:
        if self.calls is not None:
            return {"message": self.calls.whole(done.text)}
        return {"message": {"role": "assistant", "content": done.text}}

    def _chunk_body(self, chunk: GenerationChunk) -> dict:
        delta: dict = {"role": "assistant"} if self._first else {}
        self._first = False
        if self.calls is None:
            delta["content"] = chunk.text
            return {"delta": delta}
        content, tool_calls = self.calls.read(chunk.text, final=chunk.finish_reason is not None)
        if content or not tool_calls:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"delta": delta}

    def stream_chunk(self, chunk: GenerationChunk, with_usage: bool = False) -> dict | None:
        """None where a chunk's text all went into a call not yet told (nothing to send)."""
        out = super().stream_chunk(chunk, with_usage)
        choice = out["choices"][0]
        if (self.calls is not None and choice["delta"] == {"content": ""} and choice["finish_reason"] is None
                and choice["logprobs"] is None):
            return None
        return out

    def _logprobs(self, chunk: GenerationChunk) -> dict | None:
        if self.texts is None or chunk.logprobs is None:
            return None
        text = self.texts.text

        def entry(token_id: int, logprob: float) -> dict:
            t = text(token_id)
            return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

        content = [
            {**entry(tid, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
            for tid, lp in self._entries(chunk)
        ]
        return {"content": content, "refusal": None}


@dataclass(frozen=True)
class Echo:
    """What a completion shows of its prompt: `echo` (its text first, and with `logprobs` its
    tokens' logprobs first, the first token's null), vLLM's `prompt_logprobs` (top N per position),
    and whether the completion itself is left out (`max_tokens: 0` with echo)."""

    text: str | None  # the prompt as given, where it was text; None: decoded from its ids
    decode: Callable[[list[int]], str]
    echo: bool = False
    logprobs: int | None = None  # echo's top tokens per position (None: no logprobs asked)
    prompt_logprobs: int | None = None
    prompt_only: bool = False


@dataclass
class CompletionResponse(_Response):
    echo: Echo | None = None
    # characters of text before this chunk's first token (text_offset)
    _offset: int = field(default=0, init=False)
    _echoing: bool = field(default=False, init=False)  # the choice being made shows the prompt

    whole_object = chunk_object = "text_completion"

    def _shown(self, chunk: GenerationChunk) -> GenerationChunk:
        """The chunk as the response shows it: without its completion where only the prompt is asked."""
        if self.echo is None or not self.echo.prompt_only:
            return chunk
        return dataclasses.replace(chunk, text="", token_ids=[], completion_tokens=0,
                                   logprobs=None if chunk.logprobs is None else [])

    def whole(self, done: GenerationChunk) -> dict:
        return super().whole(self._shown(done))

    def stream_chunk(self, chunk: GenerationChunk, with_usage: bool = False) -> dict:
        return super().stream_chunk(self._shown(chunk), with_usage)

    def usage_chunk(self, last: GenerationChunk) -> dict:
        return super().usage_chunk(self._shown(last))

    def _whole_body(self, done: GenerationChunk) -> dict:
        return {"text": done.text}

    _chunk_body = _whole_body  # a stream's chunk carries its own text the same way

    def _choice(self, chunk: GenerationChunk, body: dict) -> dict:
        echo = self.echo
        self._echoing = echo is not None and echo.echo and chunk.prompt_ids is not None
        if self._echoing:
            prompt_text = echo.text if echo.text is not None else echo.decode(chunk.prompt_ids)
            body = {**body, "text": prompt_text + body["text"]}
        choice = super()._choice(chunk, body)
        if echo is not None and echo.prompt_logprobs is not None and chunk.prompt_ids is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(chunk, echo.prompt_logprobs)
        return choice

    def _prompt_entries(self, chunk: GenerationChunk) -> list[tuple[int, TokenLogprob | None]]:
        """The prompt's tokens and their logprobs (None for the first token, as for vLLM)."""
        ids = chunk.prompt_ids or []
        logprobs = chunk.prompt_logprobs or []
        return list(zip(ids, [None, *logprobs], strict=False))

    def _prompt_logprobs(self, chunk: GenerationChunk, top: int) -> list[dict | None]:
        """vLLM's: per prompt position, {token id: {logprob, rank, decoded_token}} of the prompt's
        token and the position's top `top`; null for the first."""
        text = self._texts().text
        out: list[dict | None] = []
        for tid, lp in self._prompt_entries(chunk):
            if lp is None:
                out.append(None)
                continue
            entry = {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(tid)}}
            for rank, (i, v) in enumerate(lp.top[:top], 1):
                entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": text(i)})
            out.append(entry)
        return out

    def _texts(self) -> TokenTexts:
        assert self.texts is not None, "a request with prompt logprobs gets token texts"
        return self.texts

    def _logprobs(self, chunk: GenerationChunk) -> dict | None:
        """The legacy API's: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset;
        with echo, the prompt's first."""
        if self.texts is None or chunk.logprobs is None:
            return None
        text = self.texts.text
        entries: list[tuple[int, TokenLogprob | None]] = list(self._entries(chunk))
        top = None
        if self._echoing and self.echo.logprobs is not None:
            entries = self._prompt_entries(chunk) + entries
            top = self.echo.logprobs
        tokens = [text(tid) for tid, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
            "top_logprobs": [
                None if lp is None else {text(i): v for i, v in lp.top[:top]} for _, lp in entries
            ],
            "text_offset": offsets,
        }
