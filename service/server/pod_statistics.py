"""The pod's model statistics as a front gets them: asked of the supervisor, which keeps them from every
front's finished requests (telemetry/model_statistics.py), so that whichever front a client reaches
answers for the whole pod. The answer comes back on the front's inbox (engine_client.py routes it)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from .. import contract as c
from ..contract import ErrorKind, RequestError

ANSWER_TIMEOUT_S = 5.0


class PodStatistics:
    def __init__(self, front: int, send: Callable[[object], None]) -> None:
        self.front = front
        self._send = send  # to the supervisor
        self._queries = itertools.count()
        self._waiting: dict[int, asyncio.Future[list[c.ModelStats]]] = {}

    async def models(self) -> list[c.ModelStats]:
        """Every model's statistics, as of the supervisor's latest records (UNAVAILABLE: no answer)."""
        query = next(self._queries)
        future: asyncio.Future[list[c.ModelStats]] = asyncio.get_running_loop().create_future()
        self._waiting[query] = future
        self._send(c.StatisticsQuery(self.front, query))
        try:
            return await asyncio.wait_for(future, ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError as exc:
            raise RequestError(ErrorKind.UNAVAILABLE, "the pod's statistics did not come in time") from exc
        finally:
            self._waiting.pop(query, None)

    def answer(self, reply: c.StatisticsReply) -> None:
        future = self._waiting.pop(reply.query, None)
        if future is not None and not future.done():
            future.set_result(reply.models)
