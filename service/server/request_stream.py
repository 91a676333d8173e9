"""One request's stream in a front: the tokens the engine sends for it, and the chunks the client gets.

A stream turns its tokens into text where the client's call runs, off the engine's path: incremental
detokenization and stop strings. Tokens that arrive while the stream is still sending (a slow client,
a busy front) wait and go out together in its next message; `StreamInterval` (the settings
`stream_interval` and `stream_interval_ms`) makes it wait on purpose, but never for the first token
or the last. No chunk but the last has empty text: tokens whose text is not out yet (a token that
ends inside a UTF-8 character, text that may begin a stop string) wait for the next chunk with text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from ..contract import ErrorKind, FinishReason, Request, RequestError, TokenLogprob
from .detokenizer import IncrementalDetokenizer, StopStringMatcher


@dataclass
class RequestTimes:
    """When the front saw a request's milestones, wall clock (time.time() seconds); None = not yet."""

    arrival: float  # the front accepted the request and sent it to the engine
    scheduled: float | None = None  # the first engine step that computed any of its prompt began
    first_token: float | None = None  # the front handed its first generated token on
    last_token: float | None = None  # ... and its last one so far


@dataclass
class GenerationChunk:
    """New output of one request since its last chunk; the last one has finish_reason set."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (known from the first token)
    times: RequestTimes | None = None  # when the front saw the request's milestones (telemetry)
    # the first chunk's: the prompt's token ids, and the logprobs of its tokens after the first
    # where the request asked for them (SamplingParams.prompt_logprobs)
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class StreamInterval:
    """A stream sends once `tokens` are waiting and `seconds` have passed since its last message
    (the first token and the last always go at once)."""

    tokens: int = 1
    seconds: float = 0.0


class RequestStream:
    """One request's outputs as they arrive from the engine, and the chunks made of them."""

    def __init__(
        self,
        request: Request,
        tokenizer: PreTrainedTokenizerBase,
        interval: StreamInterval,
        release: Callable[[RequestStream], None],
        special_tokens: bool = False,
    ) -> None:
        self.request_id = request.request_id
        self.interval = interval
        self.release = release  # called once its reader is done with it
        self.prompt_ids = request.prompt_ids
        self.prompt_len = len(request.prompt_ids)
        # as the engine sent them, with the first token (where the request asked)
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.params = params = request.params
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_ids, not special_tokens)
        self.stops = StopStringMatcher(params.stop)
        self.times = RequestTimes(arrival=time.time())
        self.cached_tokens = 0  # set with the first token (engine_client.py)
        self._ids: list[int] = []  # arrived, not yet taken
        self._logprobs: list[TokenLogprob] = []
        self._unsent: tuple[list[int], list[TokenLogprob]] = ([], [])  # taken, their text not out yet
        self._finish: FinishReason | None = None
        self._stop_token: int | None = None
        self._error: RequestError | None = None
        self._event = asyncio.Event()
        self._last_sent: float | None = None  # monotonic time of the last chunk
        self.engine_done = False  # the engine has let go of the request
        self._deadline = request.deadline  # wall clock; the stream ends with DEADLINE_EXCEEDED there

    # -- fed by the client's receive loop ---------------------------------------------------------
    def token(self, token: int) -> None:
        self._ids.append(token)
        self._event.set()

    def logprob(self, logprob: TokenLogprob) -> None:
        self._logprobs.append(logprob)

    def finish(self, reason: FinishReason, stop_token: int | None) -> None:
        self._finish, self._stop_token = reason, stop_token
        self.engine_done = True
        self._event.set()

    def _expire(self) -> None:
        if self._error is None and self._finish is None:
            self._error = RequestError(ErrorKind.DEADLINE_EXCEEDED, "the request ran past its deadline")
            self._event.set()  # engine_done stays False: the release aborts it in the engine

    def fail(self, error: RequestError) -> None:
        self._error = error
        self.engine_done = True
        self._event.set()

    # -- read where the client's call runs --------------------------------------------------------
    async def _until_due(self) -> None:
        """Wait until the stream has something to send, as the stream interval allows."""
        interval = self.interval
        while self._error is None and self._finish is None:
            wait = None
            if self._ids:
                if self._last_sent is None:
                    return
                wait = self._last_sent + interval.seconds - time.monotonic()
                if len(self._ids) >= interval.tokens and wait <= 0:
                    return
                if len(self._ids) < interval.tokens:
                    wait = None  # more tokens must come first
            self._event.clear()
            if wait is None:
                await self._event.wait()
            else:
                timer = asyncio.get_running_loop().call_later(wait, self._event.set)
                try:
                    await self._event.wait()
                finally:
                    timer.cancel()

    def _take(self) -> tuple[list[int], list[TokenLogprob] | None, FinishReason | None, int | None]:
        ids, self._ids = self._ids, []
        logprobs = None
        if self.params.logprobs:
            logprobs, self._logprobs = self._logprobs, []
        return ids, logprobs, self._finish, self._stop_token

    def _text(self, ids: list[int], ends_on_token: bool) -> tuple[list[int], str, str | None]:
        """(the ids to send, their text, the stop string that ended generation in them).
        `ends_on_token`: the last id is the stop token (EOS or a stop_token_id) that ended generation."""
        text_ids = ids[:-1] if ends_on_token else ids  # a stop token's id is sent, not its text
        if not self.params.stop:
            return ids, self.stops.feed(self.detok.add(text_ids))[0], None
        text = ""
        for i, tid in enumerate(text_ids):  # one at a time: the ids end where a stop string does
            piece, hit = self.stops.feed(self.detok.add([tid]))
            text += piece
            if hit is not None:
                return ids[: i + 1], text, hit
        return ids, text, None

    def _with_unsent(
        self, ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> tuple[list[int], list[TokenLogprob] | None]:
        """`ids` (and their logprobs) after those taken before whose text was not out yet."""
        unsent_ids, unsent_logprobs = self._unsent
        if not unsent_ids:
            return ids, logprobs
        self._unsent = ([], [])
        return unsent_ids + ids, None if logprobs is None else unsent_logprobs + logprobs

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        completion = 0
        first = True
        timer = None
        if self._deadline is not None:
            timer = asyncio.get_running_loop().call_later(self._deadline - time.time(), self._expire)
        try:
            while True:
                await self._until_due()
                if self._error is not None:
                    raise self._error
                ids, logprobs, finish, stop_reason = self._take()
                ids, text, hit = self._text(ids, finish is FinishReason.STOP)
                if hit is not None:
                    finish, stop_reason = FinishReason.STOP, hit
                    logprobs = logprobs[: len(ids)] if logprobs is not None else None
                elif finish is not None:
                    text += self.stops.flush()
                ids, logprobs = self._with_unsent(ids, logprobs)
                if not text and finish is None:  # nothing to read yet: these wait for text
                    self._unsent = (ids, logprobs or [])
                    continue
                completion += len(ids)
                if ids:
                    self.times.last_token = time.time()
                    self.times.first_token = self.times.first_token or self.times.last_token
                self._last_sent = time.monotonic()
                yield GenerationChunk(
                    text=text,
                    token_ids=ids,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    prompt_tokens=self.prompt_len,
                    completion_tokens=completion,
                    cached_tokens=self.cached_tokens,
                    times=self.times,
                    prompt_ids=self.prompt_ids if first else None,
                    prompt_logprobs=self.prompt_logprobs if first else None,
                )
                first = False
                if finish is not None:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self.release(self)


async def whole(chunks: AsyncIterator[GenerationChunk], logprobs: bool) -> GenerationChunk:
    """A request's chunks run to completion, as one chunk with everything (`logprobs`: it asked)."""
    merged = GenerationChunk(text="", token_ids=[], logprobs=[] if logprobs else None)
    async for chunk in chunks:
        merged.text += chunk.text
        merged.token_ids += chunk.token_ids
        if merged.logprobs is not None and chunk.logprobs:
            merged.logprobs += chunk.logprobs
        merged.finish_reason, merged.stop_reason = chunk.finish_reason, chunk.stop_reason
        merged.prompt_tokens, merged.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens
        merged.cached_tokens = chunk.cached_tokens
        merged.times = chunk.times
        if merged.prompt_ids is None:
            merged.prompt_ids, merged.prompt_logprobs = chunk.prompt_ids, chunk.prompt_logprobs
    return merged
