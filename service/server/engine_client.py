"""A front's side of the engine process: requests and aborts go out, each engine step's outputs come
back in one message and are routed to their requests' streams.

A stream turns its tokens into text where the client's call runs, off the engine's path: incremental
detokenization and stop strings. Tokens that arrive while the stream is still sending (a slow client,
a busy front) wait and go out together in its next message; `stream_interval` tokens and
`stream_interval_s` seconds since the last message set how long a stream waits on purpose. A stream
closed early (client gone, deadline, stop string) aborts its request, and the engine frees its KV
blocks at its next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from ..engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from ..engine.errors import ErrorKind, RequestError
from ..engine.outputs import EngineStats, TokenLogprob
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import FinishReason
from ..engine.timing import RequestTimes
from ..ipc import messages as m
from ..ipc import sockets

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 5.0  # a load query the engine has not answered by then: the engine is stuck


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
        client_request_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.interval = interval
        self.release = release  # called once its reader is done with it
        self.client_request_id = client_request_id
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = StopStringMatcher(params.stop)
        self.times = RequestTimes(arrival=time.time())
        self._ids: list[int] = []  # arrived, not yet sent
        self._logprobs: list[TokenLogprob] = []
        self._finish: FinishReason | None = None
        self._stop_token: int | None = None
        self._error: RequestError | None = None
        self._event = asyncio.Event()
        self._last_sent: float | None = None  # monotonic time of the last chunk
        self.engine_done = False  # the engine has let go of the request

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
                    times=self.times,
                )
                if finish is not None:
                    return
        finally:
            self.release(self)


class EngineClient:
    """The front's connection to the engine process (one per front process)."""

    def __init__(self, endpoints: sockets.Endpoints, front: int, interval: StreamInterval) -> None:
        self.front = front
        self.interval = interval
        self._zmq = zmq.asyncio.Context()
        self._to_engine = sockets.push(self._zmq, endpoints.engine)
        self._inbox = sockets.pull(self._zmq, endpoints.front(front))
        self._inbox_now = zmq.Socket.shadow(self._inbox.underlying)  # non-blocking reads, no future
        self._decoder = m.decoder(m.ToFront)
        self._ids = (f"{front}-{n}" for n in itertools.count())
        self.streams: dict[str, RequestStream] = {}
        self._client_ids: dict[str, str] = {}  # a client's request id in flight -> our id
        self._loads: dict[int, asyncio.Future[EngineStats]] = {}
        self._queries = itertools.count()
        self.ready: asyncio.Future[m.EngineReady] = asyncio.get_running_loop().create_future()
        self.gone: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    @property
    def num_active(self) -> int:
        return len(self.streams)

    async def run(self) -> None:
        """Receive until the engine is gone; every stream then ends with UNAVAILABLE.

        Each turn takes every message that has arrived, not one: when the front falls behind, the
        backlog then waits in the streams, where it goes out in one message per stream, instead of
        in the socket, where each stream would still get one message per engine step."""
        while not self.gone.done():
            self._handle(self._decoder.decode(await self._inbox.recv(copy=False)))
            while not self.gone.done():
                try:
                    frame = self._inbox_now.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(self._decoder.decode(frame))

    def _handle(self, msg: object) -> None:
        if isinstance(msg, m.StepOutputs):
            self._route(msg)
        elif isinstance(msg, m.LoadReply):
            future = self._loads.pop(msg.query, None)
            if future is not None and not future.done():
                future.set_result(msg.stats)
        elif isinstance(msg, m.EngineReady):
            if not self.ready.done():
                self.ready.set_result(msg)
        elif isinstance(msg, m.EngineGone):
            self.engine_gone(msg.reason)

    def _route(self, out: m.StepOutputs) -> None:
        """One engine step's outputs to their streams (a stream closed meanwhile is skipped)."""
        streams, ids = self.streams, out.request_ids
        for rid, token in zip(ids, out.tokens, strict=True):
            stream = streams.get(rid)
            if stream is not None:
                stream.token(token)
        for row, at in out.started:
            if (stream := streams.get(ids[row])) is not None:
                stream.times.scheduled = at
        for row, logprob in out.logprobs:
            if (stream := streams.get(ids[row])) is not None:
                stream.logprob(logprob)
        for row, reason, stop_token in out.finished:
            if (stream := streams.get(ids[row])) is not None:
                stream.finish(reason, stop_token)
        for rid, kind, message in out.failed:
            if (stream := streams.get(rid)) is not None:
                stream.fail(RequestError(kind, message))

    def engine_gone(self, reason: str) -> None:
        if self.gone.done():
            return
        log.error("engine process gone: %s", reason)
        self.gone.set_result(reason)
        error = RequestError(ErrorKind.UNAVAILABLE, f"the engine process has stopped ({reason}); retry")
        for stream in list(self.streams.values()):
            stream.fail(error)
        for future in self._loads.values():
            if not future.done():
                future.set_exception(error)

    def _send(self, msg: object) -> None:
        self._to_engine.send(m.encode(msg), copy=False)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase,
        client_request_id: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Send one validated request to the engine; its chunks as they come."""
        if self.gone.done():
            raise RequestError(ErrorKind.UNAVAILABLE, "the engine process has stopped; retry")
        if client_request_id and client_request_id in self._client_ids:
            raise RequestError(
                ErrorKind.INVALID_ARGUMENT, f"request id {client_request_id!r} is already in use"
            )
        stream = RequestStream(
            next(self._ids), prompt_ids, params, tokenizer, self.interval, self.release, client_request_id
        )
        self.streams[stream.request_id] = stream
        if client_request_id:
            self._client_ids[client_request_id] = stream.request_id
        self._send(m.Submit(stream.request_id, self.front, list(prompt_ids), params))
        return stream.chunks()

    def release(self, stream: RequestStream) -> None:
        """A stream's reader is done with it (finished, failed or gone)."""
        self.streams.pop(stream.request_id, None)
        if stream.client_request_id:
            self._client_ids.pop(stream.client_request_id, None)
        if not stream.engine_done and not self.gone.done():
            self._send(m.Abort([stream.request_id]))  # client gone, or a stop string ended it early

    async def generate_all(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase,
        client_request_id: str | None = None,
    ) -> GenerationChunk:
        """Run to completion; one chunk with everything."""
        merged = GenerationChunk(text="", token_ids=[], logprobs=[] if params.logprobs else None)
        async for chunk in self.generate(prompt_ids, params, tokenizer, client_request_id):
            merged.text += chunk.text
            merged.token_ids += chunk.token_ids
            if merged.logprobs is not None and chunk.logprobs:
                merged.logprobs += chunk.logprobs
            merged.finish_reason, merged.stop_reason = chunk.finish_reason, chunk.stop_reason
            merged.prompt_tokens, merged.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens
            merged.times = chunk.times
        return merged

    async def load(self) -> EngineStats:
        """The engine's load right now (answered at its next step boundary)."""
        if self.gone.done():
            raise RequestError(ErrorKind.UNAVAILABLE, "the engine process has stopped; retry")
        query = next(self._queries)
        future = asyncio.get_running_loop().create_future()
        self._loads[query] = future
        self._send(m.LoadQuery(self.front, query))
        try:
            return await asyncio.wait_for(future, LOAD_TIMEOUT_S)
        except asyncio.TimeoutError as exc:
            raise RequestError(ErrorKind.UNAVAILABLE, "the engine did not report its load in time") from exc
        finally:
            self._loads.pop(query, None)

    def close(self) -> None:
        self._to_engine.close()
        self._inbox.close()
        self._zmq.term()
