"""A front's side of the engine process: requests and aborts go out, each engine step's outputs come
back in one message and are routed to their requests' streams (request_stream.py). A stream closed
early (client gone, deadline, stop string) aborts its request, and the engine frees its KV blocks
before its next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from .. import contract as c
from ..contract import EngineStats, ErrorKind, Request, RequestError, SamplingParams
from ..ipc import sockets
from .replies import Replies
from .request_stream import GenerationChunk, RequestStream, StreamInterval

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 5.0  # a load query the engine has not answered by then: the engine is stuck


class EngineClient:
    """The front's connection to the engine process (one per front process)."""

    def __init__(self, endpoints: sockets.Endpoints, front: int, interval: StreamInterval) -> None:
        self.front = front
        self.interval = interval
        self._zmq = zmq.asyncio.Context()
        self._to_engine = sockets.push(self._zmq, endpoints.engine)
        self._inbox = sockets.pull(self._zmq, endpoints.front(front))
        self._inbox_now = zmq.Socket.shadow(self._inbox.underlying)  # non-blocking reads, no future
        self._decoder = c.decoder(c.ToFront)
        self._ids = (f"{front}-{n}" for n in itertools.count())
        self.streams: dict[str, RequestStream] = {}
        self._loads: Replies[EngineStats] = Replies(
            LOAD_TIMEOUT_S, "the engine did not report its load in time"
        )
        self.ready: asyncio.Future[c.EngineReady] = asyncio.get_running_loop().create_future()
        self.gone: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.pod_ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # every front
        # the supervisor's answers to statistics queries (pod_statistics.py)
        self.on_statistics: Callable[[c.StatisticsReply], None] = lambda reply: None

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
        if isinstance(msg, c.StepOutputs):
            self._route(msg)
        elif isinstance(msg, c.LoadReply):
            self._loads.answer(msg.query, msg.stats)
        elif isinstance(msg, c.EngineReady):
            if not self.ready.done():
                self.ready.set_result(msg)
        elif isinstance(msg, c.PodReady):
            if not self.pod_ready.done():
                self.pod_ready.set_result(None)
        elif isinstance(msg, c.EngineGone):
            self.engine_gone(msg.reason)
        elif isinstance(msg, c.StatisticsReply):
            self.on_statistics(msg)

    def _route(self, out: c.StepOutputs) -> None:
        """One engine step's outputs to their streams (a stream closed meanwhile is skipped)."""
        streams, ids = self.streams, out.request_ids
        for rid, token in zip(ids, out.tokens, strict=True):
            stream = streams.get(rid)
            if stream is not None:
                stream.token(token)
        for row, at, cached in out.started:
            if (stream := streams.get(ids[row])) is not None:
                stream.times.scheduled = at
                stream.cached_tokens = cached
        for row, logprob in out.logprobs:
            if (stream := streams.get(ids[row])) is not None:
                stream.logprob(logprob)
        for row, logprobs in out.prompt_logprobs:
            if (stream := streams.get(ids[row])) is not None:
                stream.prompt_logprobs = logprobs
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
        self._loads.fail_all(error)

    def _send(self, msg: object) -> None:
        self._to_engine.send(c.encode(msg), copy=False)

    def new_request(self, prompt_ids: list[int], params: SamplingParams, cache_scope: bytes) -> Request:
        """The record of an admitted request, under an id of this front's own: unique in the pod, so
        clients that pick the same `request_id` (only echoed back to them) never collide."""
        return Request(next(self._ids), prompt_ids, params, cache_scope, self.front)

    def generate(
        self, request: Request, tokenizer: PreTrainedTokenizerBase, special_tokens: bool = False
    ) -> AsyncIterator[GenerationChunk]:
        """Send an admitted request to the engine; its chunks as they come (`special_tokens`: their
        text keeps special tokens)."""
        if self.gone.done():
            raise RequestError(ErrorKind.UNAVAILABLE, "the engine process has stopped; retry")
        stream = RequestStream(request, tokenizer, self.interval, self.release, special_tokens)
        self.streams[stream.request_id] = stream
        self._send(request)
        return stream.chunks()

    def release(self, stream: RequestStream) -> None:
        """A stream's reader is done with it (finished, failed or gone)."""
        self.streams.pop(stream.request_id, None)
        if not stream.engine_done and not self.gone.done():
            self._send(c.Abort([stream.request_id]))  # client gone, or a stop string ended it early

    async def load(self) -> EngineStats:
        """The engine's load right now (answered at its next step boundary)."""
        if self.gone.done():
            raise RequestError(ErrorKind.UNAVAILABLE, "the engine process has stopped; retry")
        return await self._loads.ask(lambda query: self._send(c.LoadQuery(self.front, query)))

    def close(self) -> None:
        self._to_engine.close()
        self._inbox.close()
        self._zmq.term()
