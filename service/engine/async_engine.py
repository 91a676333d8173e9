"""The engine front on the asyncio side: one output queue per request, detokenization, stops.

The core thread hands each step's updates over with `loop.call_soon_threadsafe`; a request's
generator turns them into text chunks. A generator closed early (client gone, deadline, stop
string) aborts its request, and the core frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ..telemetry.request_times import RequestTimes
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .engine_core import EngineCore, SeqUpdate, TokenLogprob
from .errors import ErrorKind, RequestError
from .sampling_params import GenerationRequest, SamplingParams
from .sequence import FinishReason
from .validation import Limits, validate_prompt


@dataclass
class GenerationChunk:
    """New output of one request since the last chunk; the last one has finish_reason set."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    times: RequestTimes | None = None  # when the front saw the request's milestones (telemetry)


@dataclass
class _Stream:
    queue: asyncio.Queue[SeqUpdate] = field(default_factory=asyncio.Queue)


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: PreTrainedTokenizerBase,
        limits: Limits,
        max_waiting: int,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_waiting = max_waiting
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        core.on_updates = self._on_updates_threadsafe

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.core.start()

    def stop(self) -> None:
        self.core.stop()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def _on_updates_threadsafe(self, updates: list[SeqUpdate]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._route, updates)

    def _route(self, updates: list[SeqUpdate]) -> None:
        for u in updates:
            stream = self._streams.get(u.request_id)
            if stream is not None:
                stream.queue.put_nowait(u)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Validate, enqueue and stream one request. Raises RequestError before the first chunk."""
        validate_prompt(prompt_ids, self.limits)
        if self.core.stats().waiting >= self.max_waiting:
            raise RequestError(ErrorKind.RESOURCE_EXHAUSTED, "the request queue is full; retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"request id {request_id!r} is already in use")
        return self._stream(GenerationRequest(request_id, list(prompt_ids), params))

    async def _stream(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        stream = _Stream()
        self._streams[req.request_id] = stream
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
        stops = StopStringMatcher(req.params.stop)
        completion = 0
        done = engine_done = False  # done: this stream ended; engine_done: the core let go too
        times = RequestTimes(arrival=time.time())
        self.core.add(req)
        try:
            while not done:
                update = await stream.queue.get()
                engine_done = update.error is not None or update.finish_reason is not None
                if update.error is not None:
                    done = True
                    raise RequestError(ErrorKind.INTERNAL, update.error)
                completion += len(update.new_token_ids)
                times.scheduled = times.scheduled or update.scheduled_at
                if update.new_token_ids:
                    times.last_token = time.time()
                    times.first_token = times.first_token or times.last_token
                finish, stop_reason = update.finish_reason, update.stop_token
                # a stop token ends the text before it; its id still counts and is returned
                text_ids = update.new_token_ids if stop_reason is None else update.new_token_ids[:-1]
                text, hit = stops.feed(detok.add(text_ids))
                if hit is not None:
                    finish, stop_reason = FinishReason.STOP, hit
                elif finish is not None:
                    text += stops.flush()
                done = finish is not None
                yield GenerationChunk(
                    text=text,
                    token_ids=update.new_token_ids,
                    logprobs=update.logprobs,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=completion,
                    times=times,
                )
        finally:
            del self._streams[req.request_id]
            if not engine_done:
                self.core.abort(req.request_id)  # client gone, or a stop string ended it early

    async def generate_all(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerationChunk:
        """Run to completion; one chunk with everything."""
        merged = GenerationChunk(text="", token_ids=[], logprobs=[] if params.logprobs else None)
        async for chunk in await self.generate(prompt_ids, params, request_id):
            merged.text += chunk.text
            merged.token_ids += chunk.token_ids
            if merged.logprobs is not None and chunk.logprobs:
                merged.logprobs += chunk.logprobs
            merged.finish_reason, merged.stop_reason = chunk.finish_reason, chunk.stop_reason
            merged.prompt_tokens, merged.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens
            merged.times = chunk.times
        return merged
