"""One request's stream in a front: the tokens the engine sends for it, and the chunks the client gets.

A stream turns its tokens into text where the client's call runs, off the engine's path: incremental
detokenization and stop strings. Tokens that arrive while the stream is still sending (a slow client,
a busy front) wait and go out together in its next message; `StreamInterval` (the settings
`stream_interval` and `stream_interval_ms`) makes it wait on purpose, but never for the first token
or the last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from ..engine.errors import ErrorKind, RequestError
from ..engine.outputs import TokenLogprob
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import FinishReason
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
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (known from the first token)
    times: RequestTimes | None = None  # when the front saw the request's milestones (telemetry)


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
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase,
        interval: StreamInterval,
        release: Callable[[RequestStream], None],
        deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.interval = interval
        self.release = release  # called once its reader is done with it
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = StopStringMatcher(params.stop)
        self.times = RequestTimes(arrival=time.time())
        self.cached_tokens = 0  # set with the first token (engine_client.py)
        self._ids: list[int] = []  # arrived, not yet sent
        self._logprobs: list[TokenLogprob] = []
        self._finish: FinishReason | None = None
        self._stop_token: int | None = None
        self._error: RequestError | None = None
        self._event = asyncio.Event()
        self._last_sent: float | None = None  # monotonic time of the last chunk
        self.engine_done = False  # the engine has let go of the request
        self._deadline = deadline  # wall clock; the stream ends with DEADLINE_EXCEEDED there

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

    def _text(self, ids: list[int], stop_token: int | None) -> tuple[list[int], str, str | None]:
        """(the ids to send, their text, the stop string that ended generation in them)."""
        text_ids = ids if stop_token is None else ids[:-1]  # a stop token's id is sent, not its text
        if not self.params.stop:
            return ids, self.stops.feed(self.detok.add(text_ids))[0], None
        text = ""
        for i, tid in enumerate(text_ids):  # one at a time: the ids end where a stop string does
            piece, hit = self.stops.feed(self.detok.add([tid]))
            text += piece
            if hit is not None:
                return ids[: i + 1], text, hit
        return ids, text, None

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        completion = 0
        timer = None
        if self._deadline is not None:
            timer = asyncio.get_running_loop().call_later(self._deadline - time.time(), self._expire)
        try:
            while True:
                await self._until_due()
                if self._error is not None:
                    raise self._error
                ids, logprobs, finish, stop_reason = self._take()
                ids, text, hit = self._text(ids, stop_reason)
                if hit is not None:
                    finish, stop_reason = FinishReason.STOP, hit
                    logprobs = logprobs[: len(ids)] if logprobs is not None else None
                elif finish is not None:
                    text += self.stops.flush()
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
                )
                if finish is not None:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self.release(self)
